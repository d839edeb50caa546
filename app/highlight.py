"""A small regex syntax highlighter for code blocks in chat answers (no Qt, no Pygments).

Each language is a list of (token kind, regex) rules tried in order at every position; the
first rule that matches wins, so comments and strings come before keywords. Identifiers are
classified afterwards against keyword / builtin / type sets. The output is HTML spans with
inline colours, which is what Qt's rich text understands.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

# Token kinds a theme gives a colour to (see theme.Colors.syntax).
KINDS = ("keyword", "builtin", "type", "string", "comment", "number", "function", "meta")


@dataclass
class Language:
    name: str
    rules: list[tuple[str, str]]                 # (kind, regex) in priority order
    keywords: frozenset[str] = frozenset()
    builtins: frozenset[str] = frozenset()
    types: frozenset[str] = frozenset()
    ident: str = r"[A-Za-z_][A-Za-z0-9_]*"
    calls: bool = True                           # colour `name(` as a function
    _pattern: re.Pattern | None = field(default=None, repr=False)

    @property
    def pattern(self) -> re.Pattern:
        if self._pattern is None:
            parts = [f"(?P<{kind}{i}>{rx})" for i, (kind, rx) in enumerate(self.rules)]
            parts.append(f"(?P<ident>{self.ident})")
            self._pattern = re.compile("|".join(parts), re.MULTILINE)
        return self._pattern


def _words(s: str) -> frozenset[str]:
    return frozenset(s.split())


# Shared string / number / comment shapes.
_DQ = r'"(?:[^"\\\n]|\\.)*"?'           # "..." (unterminated runs to end of line while streaming)
_SQ = r"'(?:[^'\\\n]|\\.)*'?"
_BT = r"`(?:[^`\\]|\\.)*`?"
_NUM = r"\b(?:0[xX][0-9a-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)[a-zA-Z0-9]*\b"
_C_COMMENT = r"//[^\n]*|/\*[\s\S]*?(?:\*/|\Z)"
_HASH_COMMENT = r"#[^\n]*"

_C_KEYWORDS = """auto break case const continue default do else enum extern for goto if inline
    register restrict return sizeof static struct switch typedef union volatile while
    class namespace template typename public private protected virtual override final new delete
    this operator friend using try catch throw noexcept constexpr consteval decltype nullptr true
    false mutable explicit static_cast dynamic_cast reinterpret_cast const_cast co_await co_return
    co_yield concept requires __global__ __device__ __host__ __shared__"""
_C_TYPES = """void char short int long float double signed unsigned bool size_t ssize_t int8_t int16_t
    int32_t int64_t uint8_t uint16_t uint32_t uint64_t wchar_t auto std string vector"""

_PY_KEYWORDS = """False None True and as assert async await break class continue def del elif else
    except finally for from global if import in is lambda nonlocal not or pass raise return try
    while with yield match case"""
_PY_BUILTINS = """abs all any ascii bin bool breakpoint bytearray bytes callable chr classmethod
    compile complex delattr dict dir divmod enumerate eval exec filter float format frozenset
    getattr globals hasattr hash help hex id input int isinstance issubclass iter len list locals
    map max memoryview min next object oct open ord pow print property range repr reversed round
    set setattr slice sorted staticmethod str sum super tuple type vars zip self cls Exception
    ValueError TypeError KeyError IndexError RuntimeError"""

_JS_KEYWORDS = """break case catch class const continue debugger default delete do else export extends
    finally for function if import in instanceof let new return super switch this throw try typeof
    var void while with yield async await of static get set true false null undefined
    interface type enum implements private public protected readonly as from declare namespace"""
_JS_BUILTINS = """console window document Math JSON Promise Array Object String Number Boolean Map
    Set Symbol Error RegExp Date parseInt parseFloat require module exports"""
_JS_TYPES = "string number boolean any unknown never void object bigint"

_RUST_KEYWORDS = """as async await break const continue crate dyn else enum extern false fn for if impl
    in let loop match mod move mut pub ref return self Self static struct super trait true type
    unsafe use where while"""
_RUST_TYPES = """i8 i16 i32 i64 i128 isize u8 u16 u32 u64 u128 usize f32 f64 bool char str String
    Vec Option Result Box Rc Arc HashMap Some None Ok Err"""

_GO_KEYWORDS = """break case chan const continue default defer else fallthrough for func go goto if
    import interface map package range return select struct switch type var true false nil iota"""
_GO_TYPES = """bool byte complex64 complex128 error float32 float64 int int8 int16 int32 int64 rune
    string uint uint8 uint16 uint32 uint64 uintptr any"""
_GO_BUILTINS = "append cap close copy delete len make new panic print println recover"

_JAVA_KEYWORDS = """abstract assert break case catch class const continue default do else enum
    extends final finally for goto if implements import instanceof interface native new package
    private protected public return static strictfp super switch synchronized this throw throws
    transient try volatile while true false null var record yield fun val when object override
    namespace using"""
_JAVA_TYPES = "boolean byte char double float int long short void String Integer List Map"

_SH_KEYWORDS = """if then else elif fi for while until do done case esac in function return exit
    export local readonly declare set unset shift source alias"""
_SH_BUILTINS = """echo cd ls cat grep sed awk pip python python3 git mkdir rm cp mv chmod sudo apt
    apt-get curl wget tar make cmake conda npm printf test"""

_SQL_KEYWORDS = """select from where insert into values update set delete create table drop alter
    index view join inner left right outer full on group by order having limit offset union all
    distinct as and or not null is in like between case when then else end primary key foreign
    references default begin commit rollback transaction pragma exists returning with"""
_SQL_TYPES = "integer int text real blob varchar char boolean date timestamp float numeric"

LANGUAGES: dict[str, Language] = {}


def _register(lang: Language, *aliases: str) -> None:
    for a in (lang.name, *aliases):
        LANGUAGES[a] = lang


_register(Language(
    "python",
    [("string", r'[rRbBuUfF]{0,2}"""[\s\S]*?(?:"""|\Z)'),
     ("string", r"[rRbBuUfF]{0,2}'''[\s\S]*?(?:'''|\Z)"),
     ("comment", _HASH_COMMENT),
     ("string", r"[rRbBuUfF]{0,2}" + _DQ), ("string", r"[rRbBuUfF]{0,2}" + _SQ),
     ("meta", r"@[A-Za-z_][\w.]*"), ("number", _NUM)],
    keywords=_words(_PY_KEYWORDS), builtins=_words(_PY_BUILTINS)), "py", "python3", "py3")
_register(Language(
    "javascript",
    [("comment", _C_COMMENT), ("string", _DQ), ("string", _SQ), ("string", _BT),
     ("number", _NUM)],
    keywords=_words(_JS_KEYWORDS), builtins=_words(_JS_BUILTINS), types=_words(_JS_TYPES),
    ident=r"[A-Za-z_$][A-Za-z0-9_$]*"), "js", "jsx", "ts", "tsx", "typescript", "node")
_register(Language(
    "c",
    [("comment", _C_COMMENT), ("meta", r"^\s*#\s*\w+[^\n]*"), ("string", _DQ), ("string", _SQ),
     ("number", _NUM)],
    keywords=_words(_C_KEYWORDS), types=_words(_C_TYPES)),
    "cpp", "c++", "cc", "cxx", "h", "hpp", "cuda", "cu", "objc")
_register(Language(
    "rust",
    [("comment", _C_COMMENT), ("meta", r"#!?\[[^\]\n]*\]"), ("string", _DQ),
     ("string", r"'(?:[^'\\\n]|\\.)'"), ("number", _NUM)],
    keywords=_words(_RUST_KEYWORDS), types=_words(_RUST_TYPES)), "rs")
_register(Language(
    "go",
    [("comment", _C_COMMENT), ("string", _DQ), ("string", _SQ), ("string", _BT),
     ("number", _NUM)],
    keywords=_words(_GO_KEYWORDS), builtins=_words(_GO_BUILTINS), types=_words(_GO_TYPES)),
    "golang")
_register(Language(
    "java",
    [("comment", _C_COMMENT), ("meta", r"@[A-Za-z_]\w*"), ("string", _DQ), ("string", _SQ),
     ("number", _NUM)],
    keywords=_words(_JAVA_KEYWORDS), types=_words(_JAVA_TYPES)),
    "kotlin", "kt", "csharp", "cs", "c#", "scala", "swift", "dart")
_register(Language(
    "bash",
    [("comment", r"(?:^|(?<=\s))#[^\n]*"), ("string", _DQ), ("string", _SQ),
     ("meta", r"\$\{[^}\n]*\}?|\$[A-Za-z_0-9@#?*!$-]+"), ("number", r"\b\d+\b")],
    keywords=_words(_SH_KEYWORDS), builtins=_words(_SH_BUILTINS),
    ident=r"[A-Za-z_][A-Za-z0-9_-]*", calls=False),
    "sh", "shell", "zsh", "console", "shell-session", "powershell", "ps1", "bat", "dockerfile")
_register(Language(
    "json",
    [("type", r'"(?:[^"\\\n]|\\.)*"(?=\s*:)'), ("string", _DQ), ("number", r"-?" + _NUM)],
    keywords=_words("true false null"), calls=False), "jsonc", "json5")
_register(Language(
    "sql",
    [("comment", r"--[^\n]*|/\*[\s\S]*?(?:\*/|\Z)"), ("string", _SQ), ("string", _DQ),
     ("number", _NUM)],
    keywords=_words(_SQL_KEYWORDS), types=_words(_SQL_TYPES), calls=False), "sqlite", "postgresql",
    "mysql")
_register(Language(
    "yaml",
    [("comment", _HASH_COMMENT), ("type", r"^[ \t-]*[A-Za-z_][\w .-]*(?=\s*:)"),
     ("string", _DQ), ("string", _SQ), ("number", _NUM)],
    keywords=_words("true false null yes no on off"), calls=False), "yml", "toml", "ini", "cfg")
_register(Language(
    "html",
    [("comment", r"<!--[\s\S]*?(?:-->|\Z)"), ("keyword", r"</?[A-Za-z][\w:-]*|/?>"),
     ("string", _DQ), ("string", _SQ), ("meta", r"&\w+;")],
    ident=r"[A-Za-z_][\w:-]*", calls=False), "xml", "svg", "xhtml", "vue")
_register(Language(
    "css",
    [("comment", r"/\*[\s\S]*?(?:\*/|\Z)"), ("string", _DQ), ("string", _SQ),
     ("meta", r"[.#][A-Za-z_][\w-]*|@[\w-]+"), ("number", r"-?\d+(?:\.\d+)?(?:px|em|rem|%|s|ms|vh|vw)?"),
     ("type", r"[a-z-]+(?=\s*:)")],
    ident=r"[A-Za-z_][\w-]*", calls=False), "scss", "less")


def language_for(name: str) -> Language | None:
    """The Language for a fence info string ("python", "py", "C++", "rust,no_run", ...)."""
    key = re.split(r"[\s,{]", name.strip().lower(), maxsplit=1)[0] if name.strip() else ""
    return LANGUAGES.get(key)


def highlight(code: str, lang: str, colors: dict[str, str]) -> str:
    """HTML for `code` (escaped) with spans coloured by token kind; unknown languages are
    returned escaped only. colors maps token kinds (KINDS) to CSS colours."""
    language = language_for(lang)
    if language is None:
        return html.escape(code, quote=False)
    out: list[str] = []
    pos = 0

    def span(kind: str, text: str) -> str:
        color = colors.get(kind)
        body = html.escape(text, quote=False)
        if not color:
            return body
        weight = ";font-weight:600" if kind == "keyword" else ""
        style = f"color:{color}{weight}" + (";font-style:italic" if kind == "comment" else "")
        return f'<span style="{style}">{body}</span>'

    for m in language.pattern.finditer(code):
        if m.start() > pos:
            out.append(html.escape(code[pos:m.start()], quote=False))
        group = m.lastgroup or ""
        text = m.group()
        if group == "ident":
            kind = ""
            if text in language.keywords or (language.name == "sql" and text.lower() in language.keywords):
                kind = "keyword"
            elif text in language.types or (language.name == "sql" and text.lower() in language.types):
                kind = "type"
            elif text in language.builtins:
                kind = "builtin"
            elif language.calls and code[m.end():m.end() + 1] == "(":
                kind = "function"
            out.append(span(kind, text) if kind else html.escape(text, quote=False))
        else:
            out.append(span(group.rstrip("0123456789"), text))
        pos = m.end()
    out.append(html.escape(code[pos:], quote=False))
    return "".join(out)
