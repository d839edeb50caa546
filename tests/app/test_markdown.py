"""Markdown -> Qt rich text, and the code highlighter (Qt-free)."""
from __future__ import annotations

import re

import pytest

from tritonchat.app.highlight import KINDS, highlight, language_for
from tritonchat.app.markdown import COPY_SCHEME, RenderStyle, render_markdown, render_plain

COLORS = {k: f"#00000{i}" for i, k in enumerate(KINDS)}   # one distinct colour per token kind
STYLE = RenderStyle(syntax=COLORS)


def text_of(html: str) -> str:
    """Visible text of an HTML fragment (tags dropped, entities decoded)."""
    import html as h

    return h.unescape(re.sub(r"<[^>]+>", "", html))


def spans(html: str, kind: str) -> list[str]:
    import html as h

    return [h.unescape(m) for m in re.findall(rf'<span style="color:{COLORS[kind]}[^"]*">(.*?)</span>', html, re.S)]


# ---------------------------------------------------------------- blocks

def test_paragraphs_and_line_breaks():
    r = render_markdown("first line\nsecond line\n\nnew paragraph")
    assert r.html.count("<p ") == 2
    assert "first line<br/>second line" in r.html
    assert r.code_blocks == []


@pytest.mark.parametrize("level", range(1, 7))
def test_headings(level):
    r = render_markdown("#" * level + " Title *x*")
    assert f"<h{level}" in r.html and "<i>x</i>" in r.html
    assert render_markdown("#" * 7 + " not a heading").html.count("<h") == 0


def test_fenced_code_is_highlighted_escaped_and_copyable():
    src = "Intro\n\n```python\nif a < b:  # cmp\n    print('<tag>')\n```\nafter"
    r = render_markdown(src, STYLE)
    assert r.code_blocks == ["if a < b:  # cmp\n    print('<tag>')"]
    assert f'href="{COPY_SCHEME}:0"' in r.html
    assert "&lt;tag&gt;" in r.html and "<tag>" not in r.html
    assert "if" in spans(r.html, "keyword")
    assert "# cmp" in spans(r.html, "comment")
    assert "'<tag>'" in spans(r.html, "string")
    assert "after" in text_of(r.html).split("Copy")[-1]


def test_several_code_blocks_get_their_own_index_and_tilde_fences():
    r = render_markdown("```\na\n```\ntext\n~~~js\nb\n~~~\n````\n```\nnested\n````")
    assert r.code_blocks == ["a", "b", "```\nnested"]
    for i in range(3):
        assert f"{COPY_SCHEME}:{i}" in r.html


def test_unclosed_fence_while_streaming_runs_to_the_end():
    r = render_markdown("Here:\n```py\ndef f():\n    return 1")
    assert r.code_blocks == ["def f():\n    return 1"]
    assert "Here:" in r.html


def test_empty_and_whitespace_input():
    assert render_markdown("").html == ""
    assert render_markdown("\n\n  \n").html == ""
    r = render_markdown("```\n```")
    assert r.code_blocks == [""]


def test_unordered_ordered_and_nested_lists():
    r = render_markdown("- a\n- b\n  - c\n  - d\n- e\n\n3. x\n4. y")
    assert r.html.count("<ul") == 2 and r.html.count("<ol") == 1
    assert 'start="3"' in r.html
    assert re.sub(r"<[^>]+>", " ", r.html).split() == ["a", "b", "c", "d", "e", "x", "y"]
    # a tight list has no paragraph margins inside items
    assert "<li" in r.html and "<p " not in r.html


def test_loose_list_keeps_paragraphs():
    r = render_markdown("- one\n\n- two")
    assert r.html.count("<li") == 2
    assert r.html.count("<p ") == 2


def test_list_item_with_code_block_inside():
    r = render_markdown("1. run:\n   ```bash\n   ls -la\n   ```\n2. done")
    assert r.code_blocks == ["ls -la"]
    assert r.html.count("<li") == 2


def test_task_list_boxes():
    r = render_markdown("- [x] done\n- [ ] todo")
    assert "\u2611 done" in text_of(r.html) and "\u2610 todo" in text_of(r.html)


def test_blockquote_and_rule():
    r = render_markdown("> quoted **bold**\n> more\n\n---\n\nafter")
    assert "<b>bold</b>" in r.html and "<hr/>" in r.html
    assert "quoted" in text_of(r.html) and "more" in text_of(r.html)


def test_table_with_alignment_and_ragged_rows():
    r = render_markdown("| a | b | c |\n|:--|:-:|--:|\n| 1 | 2 |\n| x | y | z | extra |")
    assert r.html.count("<th") == 3
    assert 'align="center"' in r.html and 'align="right"' in r.html
    # ragged rows are padded / truncated to the header's width
    assert r.html.count("<td") == 6
    assert "extra" not in r.html


def test_pipe_without_separator_is_not_a_table():
    r = render_markdown("a | b\nc | d")
    assert "<table" not in r.html


# ---------------------------------------------------------------- inline

def test_emphasis_and_strikethrough():
    h = render_markdown("**b** *i* _u_ ~~s~~ __bb__").html
    assert "<b>b</b>" in h and "<i>i</i>" in h and "<i>u</i>" in h
    assert "<s>s</s>" in h and "<b>bb</b>" in h


def test_intraword_underscores_and_lone_stars_stay_literal():
    h = render_markdown("snake_case_name and 2 * 3 * 4").html
    assert "snake_case_name" in text_of(h) and "<i>" not in h
    assert "2 * 3 * 4" in text_of(h)


def test_unclosed_emphasis_stays_literal_while_streaming():
    h = render_markdown("this is **still open").html
    assert "<b>" not in h and "**still open" in text_of(h)


def test_inline_code_is_not_parsed_and_escaped():
    h = render_markdown("use `a*b*c <x>` and ``code with ` tick``").html
    assert "<i>" not in h
    assert "a*b*c &lt;x&gt;" in h
    assert "code with ` tick" in text_of(h)


def test_links_autolinks_and_unsafe_schemes():
    h = render_markdown("[site](https://example.com/a_b) <https://x.org> see https://y.org/p.").html
    assert '<a href="https://example.com/a_b"' in h
    assert '<a href="https://x.org"' in h
    assert '<a href="https://y.org/p"' in h            # trailing full stop is not part of the URL
    bad = render_markdown("[click](javascript:alert(1))").html
    assert "<a " not in bad and "javascript" in text_of(bad)


def test_images_become_links_never_loaded():
    h = render_markdown("![diagram](https://example.com/d.png)").html
    assert "<img" not in h and '<a href="https://example.com/d.png"' in h


def test_raw_html_is_shown_not_interpreted():
    h = render_markdown("<script>alert(1)</script> <b>x</b>").html
    assert "<script>" not in h and "&lt;script&gt;" in h
    assert "&lt;b&gt;x&lt;/b&gt;" in h


def test_backslash_escapes():
    h = render_markdown(r"\*not italic\* and \`not code\`").html
    assert "<i>" not in h and "<code" not in h
    assert "*not italic*" in text_of(h)


def test_control_characters_are_dropped():
    r = render_markdown("a\x00b\x1ec\x07d\n```\nx\x01y\n```")
    assert "abcd" in text_of(r.html)
    assert r.code_blocks == ["xy"]


def test_render_plain_keeps_lines_and_escapes():
    h = render_plain("a <b>\n  indented\n**not md**")
    assert h.count("<br/>") == 2
    assert "&lt;b&gt;" in h and "<b>" not in h and "**not md**" in h
    assert "&nbsp;" in h


def test_every_prefix_of_a_document_renders():
    """Streaming: each half-written prefix must render without error and keep its code."""
    doc = ("# T\n\nSome **bold** and `code`.\n\n```python\nx = [1, 2]\n```\n\n- a\n  - b\n\n"
           "| a | b |\n|---|---|\n| 1 | 2 |\n\n> q\n")
    for n in range(len(doc) + 1):
        r = render_markdown(doc[:n], STYLE)
        assert isinstance(r.html, str)
    assert render_markdown(doc, STYLE).code_blocks == ["x = [1, 2]"]


# ---------------------------------------------------------------- highlighter

def test_language_aliases():
    assert language_for("py").name == "python"
    assert language_for("C++").name == "c"
    assert language_for("rust,no_run").name == "rust"
    assert language_for("TypeScript").name == "javascript"
    assert language_for("brainfuck") is None
    assert language_for("") is None


def test_unknown_language_is_only_escaped():
    assert highlight("a < b && c", "nosuchlang", COLORS) == "a &lt; b &amp;&amp; c"


@pytest.mark.parametrize("lang,code,kind,token", [
    ("python", "def f(x):\n    return x", "keyword", "def"),
    ("python", "x = len(y)", "builtin", "len"),
    ("python", "@cache\ndef g(): pass", "meta", "@cache"),
    ("python", 's = """doc\nstring"""', "string", '"""doc\nstring"""'),
    ("python", "n = 0x1F + 3.5e-2", "number", "0x1F"),
    ("python", "foo(1)", "function", "foo"),
    ("javascript", "const a = `t${x}`; // c", "comment", "// c"),
    ("c", "#include <stdio.h>\nint main() { return 0; }", "meta", "#include <stdio.h>"),
    ("c", "int main() { /* c */ }", "type", "int"),
    ("rust", "fn main() { let v: Vec<u8> = vec![]; }", "keyword", "fn"),
    ("go", "func main() { fmt.Println(\"hi\") }", "string", '"hi"'),
    ("bash", "echo $HOME # comment", "meta", "$HOME"),
    ("sql", "select * from t where a = 'x'", "keyword", "select"),
    ("json", '{"key": 1, "b": true}', "type", '"key"'),
    ("html", '<a href="x">t</a>', "keyword", "<a"),
])
def test_highlight_token_kinds(lang, code, kind, token):
    out = highlight(code, lang, COLORS)
    assert token in spans(out, kind)
    assert text_of(out) == code                     # highlighting never changes the text


def test_strings_hide_keywords_and_comments():
    out = highlight('s = "if # not a comment"', "python", COLORS)
    assert spans(out, "comment") == [] and "if" not in spans(out, "keyword")


def test_unterminated_string_and_comment_while_streaming():
    out = highlight('x = "unterminated\ny = 1', "python", COLORS)
    assert '"unterminated' in spans(out, "string")
    assert "1" in spans(out, "number")              # the string stops at the line end
    out = highlight("a /* open comment\nstill", "c", COLORS)
    assert spans(out, "comment") == ["/* open comment\nstill"]
