"""The timing panel (the right pane of the window's splitter, closed by default): live tokens/s
and the per-kernel table.

Opening it turns engine timing on, closing turns it off (the main window wires that to
configure(timing=...)). The tok/s plot comes from on_stats, which every backend reports; the
kernel table needs the Triton backend's timing, and the panel says so on the reference one.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QColor
from PySide6.QtWidgets import (QAbstractItemView, QHeaderView, QLabel, QSplitter,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from .theme import Colors

MAX_POINTS = 4000
MAX_BARS = 12
BAR_LABEL_CHARS = 24
WIDEST_NAME = "gemv_gdn_out_proj_gatednorm"     # the decode step's longest kernel name
WIDEST_NUMBER = "3,743"                          # a number cell as wide as the LM head's GB/s
COLUMNS = ("Kernel", "Calls", "\u00b5s/tok", "Share", "GB/s", "Roofline")
COLUMN_TIPS = ("The kernel (a fused launch: its prologue and epilogue in the name)",
               "Launches per generated token",
               "GPU microseconds per generated token, each kernel timed alone (an event before "
               "and after it, so it does not overlap its neighbours)",
               "Share of the kernels' summed time", "Bytes moved per second of kernel time",
               "Achieved bandwidth as a share of the measured HBM read bandwidth")
# the decode loop's time per token against the kernels' sum: within this fraction they "match"
OVERLAP_TOLERANCE = 0.03


def kernel_sum_text(kernels: list[dict], tok_s: float | None) -> str:
    """The line under the kernel table: the kernels' summed time, which is measured one kernel
    at a time, against what the decode loop really takes per token. Under programmatic
    dependent launch the captured step overlaps each kernel with the one before it, so the sum
    is larger than the step; without the CUDA graph the host's launches make the loop slower
    than the sum. Empty without kernels."""
    total = sum(float(r.get("us_per_token") or 0.0) for r in kernels)
    if total <= 0.0:
        return ""
    text = (f"Each kernel is timed alone (an event before and after it): together "
            f"{total:,.0f} \u00b5s per token.")
    if tok_s and tok_s > 0.0:
        step = 1e6 / float(tok_s)
        text += f" The decode loop takes {step:,.0f} \u00b5s per token ({float(tok_s):,.0f} tok/s)"
        if step < total * (1.0 - OVERLAP_TOLERANCE):
            text += (": in the captured step each kernel starts while the one before it finishes "
                     "(programmatic dependent launch), so their times overlap.")
        elif step > total * (1.0 + OVERLAP_TOLERANCE):
            text += ": the rest is the host launching the kernels and the gaps between them."
        else:
            text += "."
    return text


def plan_range_text(info: dict | None) -> str:
    """The line that says which context range's kernel plans the decode step runs (the Triton
    backend keeps one set of plans, and one CUDA graph, per range of positions); empty while
    one set serves every position."""
    if not info or int(info.get("count") or 0) < 2:
        return ""
    start, below = int(info.get("start") or 0), info.get("below")
    where = (f"positions {start:,}\u2013{int(below) - 1:,}" if below is not None
             else f"positions from {start:,} on")
    text = (f"Kernel plans for context {where} (set {int(info.get('index', 0)) + 1} of "
            f"{int(info['count'])})")
    tuned = [str(n) for n in info.get("tuned") or []]
    return text + (f": {', '.join(tuned)} tuned for this range." if tuned
                   else ": the base plans.")


PLAN_RANGE_TIP = ("The decode step keeps one set of kernel launch plans, and one captured CUDA "
                  "graph, per range of context positions, and runs the set of the current "
                  "position (Settings, Engine: \u201cKernel plans tuned per context length\u201d; "
                  "off, one set serves every position).")


def format_bytes(n) -> str:
    """1.81 GiB, 12.5 MiB, 640 KiB: a small model's memory does not read as 0.00 GiB."""
    n = float(n or 0)
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" and n < 10 * size else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _short(name: str) -> str:
    """A bar label: the kernel name, elided past BAR_LABEL_CHARS (the table has it whole)."""
    return name if len(name) <= BAR_LABEL_CHARS else name[:BAR_LABEL_CHARS - 1] + "\u2026"


def _fmt(value, spec: str) -> str:
    if value is None:
        return "\u2013"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


def rate_tick(value: float) -> str:
    """A tok/s tick label in thousands past 10,000 (15k; a minor tick between thousands 10.5k),
    so the ticks stay four characters wide and the axis title clear of them whatever the rate."""
    v = float(value)
    if abs(v) >= 10_000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


class _RateAxis(pg.AxisItem):
    def tickStrings(self, values, scale, spacing):     # noqa: N802  (pyqtgraph's name)
        return [rate_tick(v * scale) for v in values]


MIN_WIDTH = 240


class TimingPanel(QWidget):
    def __init__(self, colors: Colors, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("TimingPanel")
        self.setMinimumWidth(MIN_WIDTH)
        # checked while the panel is shown (the View menu, Ctrl+T and the header button use it)
        self._toggle = QAction("Timing", self)
        self._toggle.setCheckable(True)
        self._toggle.toggled.connect(self.setVisible)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        body = QWidget(self)
        outer.addWidget(body)
        self._body = body
        layout = QVBoxLayout(body)
        layout.setContentsMargins(8, 4, 8, 8)
        layout.setSpacing(6)

        self.summary = QLabel("Generate an answer to see its speed.", body)
        self.summary.setWordWrap(True)
        self.note = QLabel(body)
        self.note.setObjectName("MutedLabel")
        self.note.setWordWrap(True)
        self.note.hide()

        self.plot = pg.PlotWidget(body, axisItems={"left": _RateAxis("left")})
        self.plot.setMinimumHeight(140)
        self.plot.setLabel("left", "decode tok/s")
        self.plot.setLabel("bottom", "tokens generated")
        self.plot.showGrid(x=True, y=True, alpha=0.2)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        # markers too: a short answer gives one or two updates, and a lone point has no line
        self.curve = self.plot.plot([], [], symbol="o", symbolSize=5)
        self.plot.disableAutoRange()       # both axes from 0: a steady rate reads flat

        self.table = QTableWidget(0, len(COLUMNS), body)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSortingEnabled(False)
        for i, tip in enumerate(COLUMN_TIPS):
            self.table.horizontalHeaderItem(i).setToolTip(tip)
        header = self.table.horizontalHeader()
        # every column as wide as its contents: the kernel name is what people read, so a panel
        # narrower than the table scrolls sideways rather than eliding names or clipping numbers
        # (the panel opens at preferred_width(), which shows them all)
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(False)
        rows = self.table.verticalHeader()
        rows.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        rows.setDefaultSectionSize(self.table.fontMetrics().height() + 8)
        self.table.setToolTip("GPU time per generated token, by kernel (each timed alone): its "
                              "share of the kernels' sum and its achieved memory bandwidth "
                              "against the measured HBM roofline")

        self.bars = pg.PlotWidget(body)
        self.bars.setMinimumHeight(120)
        self.bars.setLabel("bottom", "\u00b5s per token")
        self.bars.setMouseEnabled(x=False, y=False)
        self.bars.hideButtons()
        self.bar_item: pg.BarGraphItem | None = None

        self.kernel_sum = QLabel(body)          # the kernels' sum against the loop's time
        self.kernel_sum.setObjectName("MutedLabel")
        self.kernel_sum.setWordWrap(True)
        self.kernel_sum.hide()

        self.plan_range = QLabel(body)          # which context range's plans are running
        self.plan_range.setObjectName("MutedLabel")
        self.plan_range.setWordWrap(True)
        self.plan_range.setToolTip(PLAN_RANGE_TIP)
        self.plan_range.hide()

        self.memory = QLabel(body)
        self.memory.setObjectName("MutedLabel")

        self.split_k_note = QLabel(body)        # split-K changes nothing on this GPU
        self.split_k_note.setObjectName("MutedLabel")
        self.split_k_note.setWordWrap(True)
        self.split_k_note.hide()

        self.split = split = QSplitter(Qt.Orientation.Vertical, body)
        split.addWidget(self.plot)
        split.addWidget(self.table)
        split.addWidget(self.bars)
        split.setChildrenCollapsible(False)
        layout.addWidget(self.summary)
        layout.addWidget(self.note)
        layout.addWidget(split, 1)
        layout.addWidget(self.kernel_sum)
        layout.addWidget(self.plan_range)
        layout.addWidget(self.split_k_note)
        layout.addWidget(self.memory)

        self.xs: list[float] = []
        self.ys: list[float] = []
        self.kernels: list[dict] = []
        self.tok_s: float | None = None         # the latest decode rate (for kernel_sum)
        self.roofline: dict | None = None
        self.triton = True
        self.set_colors(colors)

    # ---------------------------------------------------------------- state
    def widget(self) -> QWidget:
        return self._body

    def toggleViewAction(self) -> QAction:     # noqa: N802  (the name QDockWidget used)
        return self._toggle

    def set_capabilities(self, capabilities: dict) -> None:
        self.triton = bool(capabilities.get("triton"))
        note = str(capabilities.get("split_k_note") or "") if self.triton else ""
        self.split_k_note.setText(note)
        self.split_k_note.setVisible(bool(note))
        if self.triton:
            self.note.hide()
        else:
            self.note.setText("Per-kernel timing needs the Triton backend on a CUDA GPU; this "
                              "engine is the PyTorch reference, so only tokens/s is plotted.")
            self.note.show()
        self.table.setVisible(self.triton)
        self.bars.setVisible(self.triton)
        if not self.triton:
            self.plan_range.setText("")
            self.plan_range.hide()
        self._update_kernel_sum()

    def set_colors(self, colors: Colors) -> None:
        self.colors = colors
        for w in (self.plot, self.bars):
            w.setBackground(colors.surface)
            for axis in ("left", "bottom"):
                w.getAxis(axis).setPen(pg.mkPen(colors.muted))
                w.getAxis(axis).setTextPen(pg.mkPen(colors.muted))
        self.curve.setPen(pg.mkPen(colors.plot_line, width=2))
        self.curve.setSymbolBrush(QColor(colors.plot_line))
        self.curve.setSymbolPen(pg.mkPen(None))
        if self.kernels:
            self._draw_bars()

    def begin_generation(self) -> None:
        """A new answer starts: the plot starts over."""
        self.xs, self.ys = [], []
        self.curve.setData([], [])

    # ---------------------------------------------------------------- updates
    def add_stats(self, stats: dict) -> None:
        """A live update, or the answer's final stats (same token count as the last update:
        that point is replaced, so the summary ends on the numbers under the answer)."""
        n, tok_s = stats.get("new_tokens"), stats.get("decode_tok_s")
        if n is not None and tok_s:
            if self.xs and self.xs[-1] == float(n):
                self.xs.pop()
                self.ys.pop()
            self.xs.append(float(n))
            self.ys.append(float(tok_s))
            if len(self.xs) > MAX_POINTS:      # a long answer keeps the plot cheap
                self.xs, self.ys = self.xs[::2], self.ys[::2]
            if self.isVisible():
                self._redraw_curve()
        parts = []
        if tok_s:
            parts.append(f"<b>{float(tok_s):,.1f}</b> tok/s")
        if stats.get("ttft_ms"):
            parts.append(f"TTFT {float(stats['ttft_ms']):,.0f} ms")
        if n is not None:
            parts.append(f"{int(n):,} tokens")
        if stats.get("context_tokens") is not None and stats.get("max_context"):
            parts.append(f"context {int(stats['context_tokens']):,} / {int(stats['max_context']):,}")
        if parts:
            self.summary.setText(" \u00b7 ".join(parts))
        if tok_s:
            self.tok_s = float(tok_s)
            self._update_kernel_sum()
        if stats.get("kernels"):
            self.set_kernels(stats["kernels"])

    def set_timings(self, info: dict) -> None:
        """What read_timings() sent: kernels, roofline, memory, the context range's plans."""
        text = plan_range_text(info.get("plan_range")) if self.triton else ""
        self.plan_range.setText(text)
        self.plan_range.setVisible(bool(text))
        if info.get("roofline"):
            self.roofline = dict(info["roofline"])
        if info.get("kernels"):
            self.set_kernels(info["kernels"])
        mem = info.get("memory") or {}
        if mem.get("total_bytes"):
            self.memory.setText(f"GPU memory: {format_bytes(mem.get('allocated_bytes', 0))} allocated, "
                                f"{format_bytes(mem.get('reserved_bytes', 0))} reserved of "
                                f"{format_bytes(mem['total_bytes'])}")
        else:
            self.memory.setText("")

    def set_kernels(self, rows: list[dict]) -> None:
        self.kernels = sorted((dict(r) for r in rows), key=lambda r: -float(r.get("us_per_token") or 0.0))
        roof = float(self.roofline["gb_s"]) if self.roofline and self.roofline.get("gb_s") else None
        self.table.setRowCount(len(self.kernels))
        for i, r in enumerate(self.kernels):
            gb_s = r.get("gb_s")
            share = r.get("share")
            cells = (str(r.get("name", "?")), _fmt(r.get("launches_per_token"), ",.0f"),
                     _fmt(r.get("us_per_token"), ",.1f"),
                     _fmt(share * 100 if share is not None else None, ".1f") + ("%" if share is not None else ""),
                     _fmt(gb_s, ",.0f"),
                     _fmt(100 * float(gb_s) / roof, ".0f") + "%" if (roof and gb_s) else "\u2013")
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if j:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(i, j, item)
        self._update_kernel_sum()
        if self.isVisible():
            self._draw_bars()

    def _update_kernel_sum(self) -> None:
        text = kernel_sum_text(self.kernels, self.tok_s) if self.triton else ""
        self.kernel_sum.setText(text)
        self.kernel_sum.setVisible(bool(text))

    def preferred_width(self) -> int:
        """A dock width that shows every column of the kernel table without scrolling (the
        decode step's longest kernel name stands in while no timings came yet)."""
        header = self.table.horizontalHeader()
        if self.kernels:                     # the sections are as wide as their contents
            cols = header.length()
        else:
            fm = self.table.fontMetrics()
            cell = 12                                               # a cell's margins
            cols = max(header.sectionSizeHint(0), fm.horizontalAdvance(WIDEST_NAME) + cell)
            cols += sum(max(header.sectionSizeHint(i), fm.horizontalAdvance(WIDEST_NUMBER) + cell)
                        for i in range(1, len(COLUMNS)))
        margins = self.widget().layout().contentsMargins()
        return (cols + self.table.verticalScrollBar().sizeHint().width()
                + 2 * self.table.frameWidth() + margins.left() + margins.right() + 4)

    def _draw_bars(self) -> None:
        if self.bar_item is not None:
            self.bars.removeItem(self.bar_item)
            self.bar_item = None
        rows = self.kernels[:MAX_BARS]
        if not rows:
            return
        ys = list(range(len(rows)))
        widths = [float(r.get("us_per_token") or 0.0) for r in rows]
        self.bar_item = pg.BarGraphItem(x0=[0] * len(rows), y=ys, height=0.7, width=widths,
                                        brush=QColor(self.colors.plot_line), pen=pg.mkPen(None))
        self.bars.addItem(self.bar_item)
        axis = self.bars.getAxis("left")
        labels = [_short(str(r.get("name", "?"))) for r in rows]
        axis.setTicks([list(zip(ys, labels))])
        # a row per label (pyqtgraph drops tick labels that would overlap) and the axis as wide
        # as the longest one
        fm = self.bars.fontMetrics()
        axis.setWidth(max(fm.horizontalAdvance(t) for t in labels) + 12)
        need = max(120, len(rows) * (fm.height() + 4) + 50)
        self.bars.setMinimumHeight(need)
        # the room comes from the table above (some Qt versions leave a laid-out splitter's
        # sizes as they were, pushing the chart's lower rows out of sight)
        sizes = self.split.sizes()
        if sum(sizes) and sizes[2] < need:
            sizes[1] = max(sizes[1] - (need - sizes[2]), 0)
            sizes[2] = need
            self.split.setSizes(sizes)
        self.bars.getViewBox().invertY(True)

    def _redraw_curve(self) -> None:
        self.curve.setData(self.xs, self.ys)
        top = max(self.ys) if self.ys else 1.0
        self.plot.setYRange(0.0, top * 1.15, padding=0)
        self.plot.setXRange(0.0, max(self.xs[-1] if self.xs else 1.0, 1.0) * 1.05, padding=0)

    def hideEvent(self, event) -> None:
        super().hideEvent(event)
        if self.isHidden():                 # hidden itself, not with its window
            self._toggle.setChecked(False)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self._toggle.setChecked(True)
        self._redraw_curve()
        if self.kernels:
            self._draw_bars()
