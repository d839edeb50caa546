"""Markdown -> Qt rich-text HTML for chat answers (no Qt here; pure string work).

Covers what chat models write: paragraphs, headings, fenced code (highlighted, with a Copy
link), inline code, bold / italic / strikethrough, links, lists (nested, ordered, task boxes),
block quotes, tables and rules. Raw HTML in the source is shown as text, never interpreted,
and images are shown as links (the view never fetches anything).

It must cope with half-written text, because the streaming answer is re-rendered as it grows:
an unclosed code fence renders as a code block that runs to the end, and unclosed emphasis
stays literal until its closing marker arrives.

A single newline inside a paragraph is a line break (chat habit, as in GitHub comments).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from .highlight import highlight

COPY_SCHEME = "copy-code"       # <a href="copy-code:N"> copies code block N of the message


@dataclass
class RenderStyle:
    """Colours and fonts the HTML is written with (theme.Colors makes one)."""

    text: str = "#1f2328"
    muted: str = "#6b7280"
    link: str = "#2563eb"
    code_bg: str = "#f6f8fa"
    code_header_bg: str = "#eaeef2"
    code_text: str = "#1f2328"
    inline_code_bg: str = "#eff1f3"
    quote_bar: str = "#d0d7de"
    table_border: str = "#d0d7de"
    mono_family: str = "monospace"
    syntax: dict[str, str] = field(default_factory=dict)


@dataclass
class Rendered:
    html: str
    code_blocks: list[str]           # raw code of each fenced block, indexed by the copy links


_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})[ \t]*([^`\n]*?)[ \t]*$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_RULE = re.compile(r"^ {0,3}(?:(?:\*[ \t]*){3,}|(?:-[ \t]*){3,}|(?:_[ \t]*){3,})$")
_QUOTE = re.compile(r"^ {0,3}> ?(.*)$")
_ITEM = re.compile(r"^( *)([-*+]|\d{1,9}[.)])([ \t]+|$)(.*)$")
_TABLE_SEP = re.compile(r"^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$")
_TASK = re.compile(r"^\[([ xX])\][ \t]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")   # invisible; Qt may draw boxes


class _Renderer:
    def __init__(self, style: RenderStyle):
        self.s = style
        self.code_blocks: list[str] = []

    # ---------------------------------------------------------------- blocks
    def blocks(self, lines: list[str], tight: bool = False) -> str:
        """Block-level pass. tight: paragraphs of a tight list item lose their <p> margins."""
        out: list[str] = []
        i, n = 0, len(lines)
        while i < n:
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            fence = _FENCE.match(line)
            if fence:
                i = self._code_block(lines, i, fence, out)
                continue
            heading = _HEADING.match(line)
            if heading:
                level = len(heading.group(1))
                size = {1: "x-large", 2: "large", 3: "medium"}.get(level, "medium")
                out.append(f'<h{level} style="font-size:{size}; margin-top:10px; margin-bottom:4px;">'
                           f"{self.inline(heading.group(2) or '')}</h{level}>")
                i += 1
                continue
            if _RULE.match(line):
                out.append("<hr/>")
                i += 1
                continue
            if _QUOTE.match(line):
                quoted: list[str] = []
                while i < n and lines[i].strip():
                    q = _QUOTE.match(lines[i])
                    quoted.append(q.group(1) if q else lines[i])
                    i += 1
                out.append(
                    f'<table width="100%" cellspacing="0" cellpadding="0" style="margin-top:4px; margin-bottom:4px;">'
                    f'<tr><td width="3" bgcolor="{self.s.quote_bar}"></td>'
                    f'<td style="padding-left:10px; color:{self.s.muted};">{self.blocks(quoted)}</td></tr></table>')
                continue
            item = _ITEM.match(line)
            if item and not (_RULE.match(line)):
                i = self._list(lines, i, out)
                continue
            if i + 1 < n and "|" in line and _TABLE_SEP.match(lines[i + 1]) and "-" in lines[i + 1]:
                i = self._table(lines, i, out)
                continue
            i = self._paragraph(lines, i, out, tight)
        return "\n".join(out)

    def _paragraph(self, lines: list[str], i: int, out: list[str], tight: bool) -> int:
        para: list[str] = []
        n = len(lines)
        while i < n:
            line = lines[i]
            if not line.strip():
                break
            if para and (_FENCE.match(line) or _HEADING.match(line) or _QUOTE.match(line)
                         or _RULE.match(line) or _ITEM.match(line)):
                break
            para.append(line.strip())
            i += 1
        body = "<br/>".join(self.inline(p) for p in para)
        out.append(body if tight else f'<p style="margin-top:0px; margin-bottom:8px;">{body}</p>')
        return i

    def _code_block(self, lines: list[str], i: int, fence: re.Match, out: list[str]) -> int:
        indent, marker, info = len(fence.group(1)), fence.group(2), fence.group(3)
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = re.match(r"^ {0,3}(`{3,}|~{3,})[ \t]*$", lines[i])
            if close and close.group(1)[0] == marker[0] and len(close.group(1)) >= len(marker):
                i += 1
                break
            line = lines[i]
            # drop up to the fence's own indentation from each content line
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(indent, strip):])
            i += 1
        code = "\n".join(body)
        out.append(self.code_html(code, info))
        return i

    def code_html(self, code: str, info: str) -> str:
        index = len(self.code_blocks)
        self.code_blocks.append(code)
        lang = info.split()[0] if info.split() else ""
        s = self.s
        body = highlight(code, lang, s.syntax) if code else "&nbsp;"
        label = html.escape(lang) if lang else "code"
        # Qt rich text: a one-column table is the reliable way to get a shaded box. The code
        # keeps its spaces and line breaks but wraps a line longer than the bubble
        # (pre-wrap): the message has no horizontal scroll bar, so nothing is clipped.
        return (
            f'<table width="100%" cellspacing="0" cellpadding="0" border="0" '
            f'style="margin-top:4px; margin-bottom:10px;">'
            f'<tr><td bgcolor="{s.code_header_bg}" style="padding:3px 10px 3px 10px; color:{s.muted};">'
            f'<span style="font-size:small;">{label}</span></td>'
            f'<td bgcolor="{s.code_header_bg}" align="right" style="padding:3px 10px 3px 10px;">'
            f'<a href="{COPY_SCHEME}:{index}" style="color:{s.link}; text-decoration:none; font-size:small;">'
            f'Copy</a></td></tr>'
            f'<tr><td colspan="2" bgcolor="{s.code_bg}" style="padding:8px 10px 8px 10px;">'
            f'<pre style="font-family:\'{s.mono_family}\'; color:{s.code_text}; margin:0px; '
            f'white-space:pre-wrap;">{body}</pre>'
            f'</td></tr></table>')

    def _list(self, lines: list[str], i: int, out: list[str]) -> int:
        first = _ITEM.match(lines[i])
        assert first is not None
        base = len(first.group(1))
        ordered = first.group(2)[0].isdigit()
        start = int(first.group(2)[:-1]) if ordered else 1
        items: list[list[str]] = []
        n = len(lines)
        content_indent = base + 2
        while i < n:
            line = lines[i]
            m = _ITEM.match(line)
            if m and len(m.group(1)) <= base + 1 and (m.group(2)[0].isdigit()) == ordered:
                content_indent = len(m.group(1)) + len(m.group(2)) + max(1, len(m.group(3)))
                items.append([m.group(4)])
                i += 1
                continue
            if not line.strip():
                # a blank line continues the list only if an indented or item line follows
                j = i + 1
                while j < n and not lines[j].strip():
                    j += 1
                if j < n and (len(lines[j]) - len(lines[j].lstrip(" ")) >= content_indent
                              or (_ITEM.match(lines[j]) and len(_ITEM.match(lines[j]).group(1)) <= base + 1
                                  and _ITEM.match(lines[j]).group(2)[0].isdigit() == ordered)):
                    items[-1].append("")
                    i += 1
                    continue
                break
            indent = len(line) - len(line.lstrip(" "))
            if indent >= min(content_indent, base + 2):
                items[-1].append(line[min(indent, content_indent):])
                i += 1
                continue
            if m or _FENCE.match(line) or _HEADING.match(line) or _QUOTE.match(line) or _RULE.match(line):
                break
            items[-1].append(line.strip())        # lazy continuation of the item's paragraph
            i += 1
        tag = "ol" if ordered else "ul"
        start_attr = f' start="{start}"' if ordered and start != 1 else ""
        parts = [f'<{tag}{start_attr} style="margin-top:0px; margin-bottom:8px;">']
        # loose list = blank lines between or inside items: its paragraphs keep their spacing
        tight = True
        for k, item in enumerate(items):
            trailing = False
            while item and not item[-1].strip():
                item.pop()
                trailing = True
            if (trailing and k < len(items) - 1) or any(not line.strip() for line in item):
                tight = False
        for item in items:
            text = item[0] if item else ""
            box = ""
            task = _TASK.match(text)
            if task:
                box = "\u2611 " if task.group(1).lower() == "x" else "\u2610 "
                item[0] = text[task.end():]
            inner = self.blocks(item, tight) if item else ""
            parts.append(f'<li style="margin-bottom:2px;">{box}{inner}</li>')
        parts.append(f"</{tag}>")
        out.append("".join(parts))
        return i

    def _table(self, lines: list[str], i: int, out: list[str]) -> int:
        def cells(row: str) -> list[str]:
            row = row.strip()
            if row.startswith("|"):
                row = row[1:]
            if row.endswith("|") and not row.endswith("\\|"):
                row = row[:-1]
            return [c.strip() for c in re.split(r"(?<!\\)\|", row)]

        header = cells(lines[i])
        aligns = []
        for spec in cells(lines[i + 1]):
            left, right = spec.startswith(":"), spec.endswith(":")
            aligns.append("center" if left and right else "right" if right else "left")
        i += 2
        rows = []
        while i < len(lines) and lines[i].strip() and "|" in lines[i]:
            rows.append(cells(lines[i]))
            i += 1
        s = self.s
        ncol = len(header)
        parts = [f'<table cellspacing="0" cellpadding="5" border="1" '
                 f'style="border-collapse:collapse; border-color:{s.table_border}; margin-bottom:10px;">']
        parts.append("<tr>" + "".join(
            f'<th align="{aligns[k] if k < len(aligns) else "left"}" bgcolor="{s.code_header_bg}">{self.inline(c)}</th>'
            for k, c in enumerate(header)) + "</tr>")
        for row in rows:
            row = (row + [""] * ncol)[:ncol]
            parts.append("<tr>" + "".join(
                f'<td align="{aligns[k] if k < len(aligns) else "left"}">{self.inline(c)}</td>'
                for k, c in enumerate(row)) + "</tr>")
        parts.append("</table>")
        out.append("".join(parts))
        return i

    # ---------------------------------------------------------------- inline
    def inline(self, text: str) -> str:
        """Inline markdown -> HTML. Code spans and links are cut out first (their insides are
        not parsed for emphasis), the rest is escaped, emphasis applied, then they go back."""
        held: list[str] = []

        def hold(fragment: str) -> str:
            held.append(fragment)
            return f"\x00{len(held) - 1}\x00"

        s = self.s
        text = text.replace("\x00", "")

        def code_span(m: re.Match) -> str:
            body = m.group(3)
            if body.startswith(" ") and body.endswith(" ") and body.strip():
                body = body[1:-1]
            return hold(f'<code style="font-family:\'{s.mono_family}\'; background-color:{s.inline_code_bg};">'
                        f"{html.escape(body, quote=False)}</code>")

        # one left-to-right pass: a backslash-escaped backtick opens no code span, and
        # backslashes inside a code span stay literal
        text = re.sub(r"\\([!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~])|(?<!`)(`+)(?!`)(.+?)(?<!`)\2(?!`)",
                      lambda m: hold(html.escape(m.group(1))) if m.group(1) else code_span(m), text)

        def link(m: re.Match) -> str:
            image, label, url = m.group(1), m.group(2), m.group(3).strip().split(" ")[0].strip("<>")
            if not re.match(r"(?i)^(https?:|mailto:)", url):
                return hold(html.escape(m.group(0), quote=False))
            label_html = self.inline(label) if label else html.escape(url)
            if image:
                label_html = "\U0001F5BC " + (label_html or "image")
            return hold(f'<a href="{html.escape(url, quote=True)}" style="color:{s.link};">{label_html}</a>')

        text = re.sub(r"(!?)\[([^\[\]]*)\]\(([^()\s]*(?:\([^()\s]*\)[^()\s]*)*(?: \"[^\"]*\")?)\)", link, text)

        def autolink(m: re.Match) -> str:
            url = m.group(1) or m.group(2)
            trail = ""
            while url and url[-1] in ".,;:!?)'\"":
                if url[-1] == ")" and url.count("(") >= url.count(")"):
                    break
                trail = url[-1] + trail
                url = url[:-1]
            return hold(f'<a href="{html.escape(url, quote=True)}" style="color:{s.link};">'
                        f"{html.escape(url, quote=False)}</a>") + html.escape(trail, quote=False)

        text = re.sub(r"<(https?://[^>\s]+)>|(?<![\w/\"'=])(https?://[^\s<>\x00]+)", autolink, text)

        text = html.escape(text, quote=False)
        text = re.sub(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1", r"<b>\2</b>", text)
        text = re.sub(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])", r"<i>\1</i>", text)
        text = re.sub(r"(?<![\w_])_(?=[^\s_])(.+?)(?<=[^\s_])_(?![\w_])", r"<i>\1</i>", text)
        text = re.sub(r"~~(?=\S)(.+?)(?<=\S)~~", r"<s>\1</s>", text)

        # put held fragments back (they may nest: a link label holding code)
        while "\x00" in text:
            new = re.sub(r"\x00(\d+)\x00", lambda m: held[int(m.group(1))], text)
            if new == text:
                break
            text = new
        return text


def render_markdown(text: str, style: RenderStyle | None = None) -> Rendered:
    """Render a (possibly half-streamed) markdown answer to Qt rich-text HTML."""
    r = _Renderer(style or RenderStyle())
    text = _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = text.expandtabs(4).split("\n")
    body = r.blocks(lines)
    return Rendered(html=body, code_blocks=r.code_blocks)


def render_plain(text: str) -> str:
    """User messages: shown as typed (escaped, line breaks kept), no markdown."""
    escaped = html.escape(_CONTROL.sub("", text), quote=False).replace("\n", "<br/>")
    # keep runs of spaces visible without turning the message into <pre>
    return re.sub(r"  ", " &nbsp;", escaped)
