"""Light / dark / system themes: one palette of named colours, applied to Qt and to the HTML."""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

from dataclasses import dataclass, field

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFontDatabase, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from .markdown import RenderStyle

THEMES = ("system", "light", "dark")


@dataclass(frozen=True)
class Colors:
    name: str
    window: str
    surface: str            # the chat area
    sidebar: str
    text: str
    muted: str
    border: str
    accent: str
    accent_text: str
    accent_hover: str
    user_bubble: str
    input_bg: str
    link: str
    code_bg: str
    code_header_bg: str
    inline_code_bg: str
    banner_bg: str
    banner_text: str
    danger: str
    plot_line: str
    syntax: dict = field(default_factory=dict)


LIGHT = Colors(
    name="light", window="#f3f4f6", surface="#ffffff", sidebar="#f3f4f6", text="#1f2328",
    muted="#6b7280", border="#d9dce1", accent="#4f46e5", accent_text="#ffffff",
    accent_hover="#4338ca", user_bubble="#eef2ff", input_bg="#ffffff", link="#2563eb",
    code_bg="#f6f8fa", code_header_bg="#e9ecf0", inline_code_bg="#eef0f3",
    banner_bg="#fff4d6", banner_text="#5c4400", danger="#c62828", plot_line="#4f46e5",
    syntax={"keyword": "#a626a4", "builtin": "#0184bc", "type": "#c18401", "string": "#50a14f",
            "comment": "#8a919a", "number": "#986801", "function": "#4078f2", "meta": "#e45649"})

DARK = Colors(
    name="dark", window="#1b1d22", surface="#22252b", sidebar="#1b1d22", text="#e6e7ea",
    muted="#9aa0a9", border="#363a42", accent="#818cf8", accent_text="#111318",
    accent_hover="#a5b4fc", user_bubble="#2d3140", input_bg="#2a2d34", link="#8ab4f8",
    code_bg="#17191d", code_header_bg="#2b2f36", inline_code_bg="#33373f",
    banner_bg="#4a3b12", banner_text="#ffe6a8", danger="#ef5350", plot_line="#a5b4fc",
    syntax={"keyword": "#c678dd", "builtin": "#56b6c2", "type": "#e5c07b", "string": "#98c379",
            "comment": "#7f848e", "number": "#d19a66", "function": "#61afef", "meta": "#e06c75"})


def system_is_dark() -> bool:
    app = QGuiApplication.instance()
    if app is None:
        return False
    return QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark


def resolve(mode: str) -> Colors:
    """Colours for a theme setting ("system" follows the desktop; unknown counts as light)."""
    if mode == "dark" or (mode == "system" and system_is_dark()):
        return DARK
    return LIGHT


def mono_family() -> str:
    return QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()


def render_style(c: Colors) -> RenderStyle:
    return RenderStyle(text=c.text, muted=c.muted, link=c.link, code_bg=c.code_bg,
                       code_header_bg=c.code_header_bg, code_text=c.text,
                       inline_code_bg=c.inline_code_bg, quote_bar=c.border,
                       table_border=c.border, mono_family=mono_family(), syntax=dict(c.syntax))


def palette(c: Colors) -> QPalette:
    p = QPalette()
    role = QPalette.ColorRole
    for r, v in ((role.Window, c.window), (role.WindowText, c.text), (role.Base, c.surface),
                 (role.AlternateBase, c.window), (role.Text, c.text), (role.Button, c.window),
                 (role.ButtonText, c.text), (role.ToolTipBase, c.surface),
                 (role.ToolTipText, c.text), (role.Highlight, c.accent),
                 (role.HighlightedText, c.accent_text), (role.Link, c.link),
                 (role.PlaceholderText, c.muted), (role.Mid, c.border), (role.Midlight, c.border)):
        p.setColor(r, QColor(v))
    disabled = QPalette.ColorGroup.Disabled
    for r in (role.WindowText, role.Text, role.ButtonText):
        p.setColor(disabled, r, QColor(c.muted))
    return p


def stylesheet(c: Colors) -> str:
    """Application style sheet: only what the palette cannot say (radii, paddings, accents)."""
    return f"""
    QWidget#Sidebar {{ background: {c.sidebar}; border-right: 1px solid {c.border}; }}
    QWidget#ChatSurface, QScrollArea#ChatScroll, QWidget#ChatContent {{ background: {c.surface}; }}
    QFrame#UserBubble {{ background: {c.user_bubble}; border-radius: 12px; }}
    QFrame#ThinkingBox {{ border-left: 3px solid {c.border}; }}
    QLabel#RoleLabel {{ color: {c.muted}; font-weight: 600; }}
    QLabel#StatsLabel, QLabel#MutedLabel {{ color: {c.muted}; }}
    QLabel#WelcomeTitle {{ font-size: 22pt; font-weight: 600; }}
    QLabel#WelcomeText {{ color: {c.muted}; }}
    QFrame#InputFrame {{ background: {c.input_bg}; border: 1px solid {c.border}; border-radius: 14px; }}
    QPlainTextEdit#InputBox {{ background: transparent; border: none; }}
    QPushButton#PrimaryButton {{ background: {c.accent}; color: {c.accent_text}; border: none;
        border-radius: 8px; padding: 6px 16px; font-weight: 600; }}
    QPushButton#PrimaryButton:hover {{ background: {c.accent_hover}; }}
    QPushButton#PrimaryButton:disabled {{ background: {c.border}; color: {c.muted}; }}
    QPushButton#StopButton {{ background: {c.danger}; color: white; border: none; border-radius: 8px;
        padding: 6px 16px; font-weight: 600; }}
    QToolButton#MessageAction {{ border: none; color: {c.muted}; padding: 2px 6px; border-radius: 6px; }}
    QToolButton#MessageAction:hover {{ background: {c.border}; color: {c.text}; }}
    QToolButton#ThinkingToggle {{ border: none; color: {c.muted}; font-style: italic; padding: 2px 0px; }}
    QListWidget#ConversationList {{ background: transparent; border: none; }}
    QListWidget#ConversationList::item {{ padding: 7px 8px; border-radius: 8px; }}
    QListWidget#ConversationList::item:selected {{ background: {c.user_bubble}; color: {c.text}; }}
    QListWidget#ConversationList::item:hover:!selected {{ background: {c.border}; }}
    QLineEdit#SearchBox {{ border: 1px solid {c.border}; border-radius: 8px; padding: 5px 8px;
        background: {c.input_bg}; }}
    QPushButton#NewChatButton {{ border: 1px solid {c.border}; border-radius: 8px; padding: 7px;
        background: {c.surface}; font-weight: 600; text-align: left; padding-left: 12px; }}
    QPushButton#NewChatButton:hover {{ background: {c.user_bubble}; }}
    QProgressBar#ContextMeter {{ border: 1px solid {c.border}; border-radius: 4px; background: {c.surface};
        max-height: 8px; }}
    QProgressBar#ContextMeter::chunk {{ background: {c.accent}; border-radius: 3px; }}
    QFrame#EditBox {{ border: 1px solid {c.accent}; border-radius: 12px; background: {c.input_bg}; }}
    """


def apply_theme(app: QApplication, mode: str) -> Colors:
    """Set Fusion + our palette + style sheet on the application; returns the colours used."""
    c = resolve(mode)
    if app.style().name().lower() != "fusion":
        app.setStyle("Fusion")
    app.setPalette(palette(c))
    sheet = stylesheet(c)
    if app.styleSheet() != sheet:          # re-polishing every widget is not free
        app.setStyleSheet(sheet)
    return c
