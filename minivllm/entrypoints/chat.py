"""Chat prompts: a conversation to the token ids the engine sees, in one place (`LLM.chat`, the cache autopsy,
and whatever else renders a chat). Plumbing, not taught.

Conversations are checked before any work is done. The chat template is code that came with the checkpoint
(a GGUF file, a hub folder), so it is rendered as transformers renders it, in jinja2's immutable sandbox with
transformers' filters and globals (`tojson`, `raise_exception`, `strftime_now`, `{% generation %}`), and with
two bounds of our own, since the sandbox stops a template from touching Python objects but not from asking for
gigabytes or hours:

- **Size.** One C-level operation can allocate gigabytes before any clock is read (`'x' * 10**9`,
  `'%*s' % (10**9, '')`, `s.ljust(10**9)`, `big|join`, `2 ** 10**9`). Every operation that can build a large
  value is checked before it runs: the operators `*`, `**`, `+`, `%` and `~`, the methods of strings that
  pad, join, replace or format, every filter, and every value printed. None may build more than
  `max_render_chars` characters (a megabyte, or four times the conversation when that is more), and neither
  may the output. jinja2's sandbox already caps `range` at 100,000 items.
- **Time.** Every Python line the render executes checks the clock, so a template that runs past the deadline
  (two nested `range(100000)` loops are 10^10 steps) is stopped in that thread, its own.

Either way the render is refused with a ValueError naming the template and what it tried.
"""

import contextvars
import functools
import json
import re
import string
import sys
import time
import types
from datetime import datetime

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg

RENDER_DEADLINE_S = 1.0  # a real chat template renders in about a millisecond
RENDER_MIN_CHARS = 1 << 20  # the most characters a render may build: this, or 4 times the conversation's if more
MAX_INT_BITS = 1 << 16  # the largest integer a render may compute (`*`, `**`): 65,536 bits, 19,729 digits


class _Overdue(BaseException):
    """Raised inside the render when it runs past its deadline; a BaseException, so that no `except Exception`
    in the template's machinery can swallow it."""


class TemplateTooLarge(jinja2.exceptions.SecurityError):
    """An operation refused before it ran, for the size of what it would build."""


_limit = contextvars.ContextVar("max_render_chars", default=RENDER_MIN_CHARS)  # per render, per thread


def check_conversation(conversation, where: str = "messages") -> None:
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where}: a conversation is a non-empty list of {{'role', 'content'}} messages")
    for j, message in enumerate(conversation):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}[{j}]: each message needs a 'role' and a 'content', both strings")


# ---------------------------------------------------------------------------------------------- sizes
def text_size(value, limit: int) -> int:
    """About how many characters str(value) has (strings and containers counted exactly enough, anything
    else as 24), without building it; counting stops once past limit, so this costs at most ~limit / 2 steps
    however deeply a template nested one list inside itself."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Namespace):
            stack.append(dict(item._Namespace__attrs))  # noqa: SLF001 (jinja2 keeps a namespace's values there)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2  # its decimal digits, about
        else:
            total += 24
    return total


_UNTRACED = text_size.__code__


def _refuse(what: str, size: int) -> None:
    limit = _limit.get()
    raise TemplateTooLarge(f"{what} would build about {size:,} characters, more than the {limit:,} a chat "
                           f"template may build")


def _check_size(what: str, size: int) -> None:
    if size > _limit.get():
        _refuse(what, size)


def _check_values(what: str, values) -> None:
    """Every argument of a call or filter: no string or container past the limit, no integer that is a size
    past it (a width, a count, a repetition)."""
    limit = _limit.get()
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise TemplateTooLarge(f"{what} with the number {value:,}: more than the {limit:,} characters a chat "
                                   f"template may build")
        _check_size(what, text_size(value, limit))


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_printf(fmt: str, args) -> None:
    """`fmt % args` (and the `format` filter): widths and precisions are sizes; `*` takes one from args."""
    widths = 0
    for width, precision in _PRINTF.findall(fmt):
        if "*" in (width, precision):
            raise TemplateTooLarge("a '%' format with a '*' width or precision is not allowed in a chat template")
        widths += int(width or 0) + int(precision or 0)
    _check_size(f"the format {fmt[:40]!r}", len(fmt) + widths + text_size(args, _limit.get()))


def _check_str_format(fmt: str, args, kwargs) -> None:
    """`fmt.format(...)`: each field's width and precision are sizes; a field nested in a spec is refused."""
    widths = 0
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise TemplateTooLarge("a str.format spec with a nested field is not allowed in a chat template")
        widths += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    _check_size(f"the format {fmt[:40]!r}", len(fmt) + widths + text_size([args, kwargs], _limit.get()))


def _check_str_method(method, args, kwargs) -> tuple:
    """A method of a string: the ones whose result can be far larger than the string and its arguments.
    Returns the arguments to call it with."""
    s, name, limit = method.__self__, method.__name__, _limit.get()
    if name in ("ljust", "rjust", "center", "zfill") and args:
        _check_size(f"str.{name}({args[0]})", max(len(s), args[0]))
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_size(f"str.expandtabs({tab})", len(s) + s.count("\t") * max(tab, 0))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = s.count(old) if old else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        _check_size(f"str.replace with {len(new):,} characters", len(s) + count * max(len(new) - len(old), 0))
    elif name == "join" and args:
        items = list(args[0])
        _check_size(f"str.join of {len(items):,} items", text_size(items, limit) + len(s) * len(items))
        return (items, *args[1:])  # the items, listed once: a generator would be used up by the check
    return args


# ------------------------------------------------------------------------------------ the environment
class _BoundedCodeGenerator(CodeGenerator):
    """jinja2 compiles `a ~ b` to a plain join that no sandbox hook sees; here it calls the environment."""

    def visit_Concat(self, node, frame):
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag (it marks the assistant's tokens for
    training): rendered as its body, as transformers does when it does not track them."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateNamespace(Namespace):
    """transformers' namespace: no underscore-prefixed attribute can be stored on it."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")


class _TemplateDict:
    """transformers' `dict` global: dict(...) and dict.fromkeys(...), and no way to the class itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson (no HTML escaping), with the size its indentation adds checked first."""
    step, limit = max(indent if isinstance(indent, int) else len(indent or ""), 0), _limit.get()
    size, stack = text_size(x, limit), [(x, 1)]  # then each item's line break and indentation, depth by depth
    while stack and size <= limit:
        value, depth = stack.pop()
        if isinstance(value, (list, tuple, dict)):
            size += len(value) * (1 + step * depth)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    _check_size(f"tojson(indent={step})", size)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (immutable sandbox, trim_blocks, lstrip_blocks, loop controls,
    its filters and globals), with every operation that can build a large value checked first."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation],
                         finalize=self._finalize)
        self.filters["tojson"] = _tojson
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_TemplateNamespace,
                            dict=_TemplateDict())
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

    @staticmethod
    def _finalize(value):  # every {{ value }} before it is printed
        _check_size("printing a value", text_size(value, _limit.get()))
        return value

    def bounded_concat(self, parts):  # `a ~ b ~ c`
        _check_size("'~'", sum(text_size(p, _limit.get()) for p in parts))
        return markup_join(parts) if any(hasattr(p, "__html__") for p in parts) else str_join(parts)

    def call_binop(self, context, operator, left, right):
        limit = _limit.get()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooLarge(f"'*' of two integers of {left.bit_length() + right.bit_length():,} bits")
        if operator == "*" and not ints:
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 1:
                    _check_size(f"'*' {n:,} times", (len(seq) if isinstance(seq, str) else text_size(seq, limit)) * n)
        if operator == "**" and ints and abs(left) > 1 and right > 0 and \
                right * (abs(left).bit_length() - 1) > MAX_INT_BITS:
            raise TemplateTooLarge(f"'**' with an integer result of more than {MAX_INT_BITS:,} bits")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_size("'+'", text_size(left, limit) + text_size(right, limit))
        if operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox's wrapper of str.format wraps the method
        if isinstance(method, types.BuiltinMethodType) and isinstance(getattr(method, "__self__", None), str):
            if method.__name__ in ("format", "format_map"):
                _check_str_format(method.__self__, args, kwargs)
            else:
                args = _check_str_method(method, args, kwargs)
        if isinstance(__obj, (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodWrapperType)):
            _check_values(f"calling {getattr(__obj, '__name__', 'a function')}", list(args) + list(kwargs.values()))
        return super().call(__context, __obj, *args, **kwargs)

    @staticmethod
    def _bounded_filter(name, function):
        """The filter, with its value and arguments checked, and the filters that multiply sizes estimated."""
        passes_first = _PassArg.from_obj(function) is not None  # a context, eval context or environment first

        @functools.wraps(function)
        def bounded(*args, **kwargs):
            head, value, rest = (args[:1], args[1], args[2:]) if passes_first else ((), args[0], args[1:])
            if name in ("join", "sum", "batch") and not isinstance(value, (str, list, tuple)):
                value = list(value)  # a generator would be used up by the check
            what, limit = f"the filter {name!r}", _limit.get()
            _check_values(what, [value, *rest, *kwargs.values()])
            size = text_size(value, limit)
            if name == "indent":
                width = rest[0] if rest else kwargs.get("width", 4)
                width = width if isinstance(width, int) else len(str(width))
                _check_size(what, size + (str(value).count("\n") + 1) * width)
            elif name == "wordwrap":
                wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
                _check_size(what, size * (1 + len(wrap)))
            elif name == "join":
                d = rest[0] if rest else kwargs.get("d", "")
                _check_size(what, size + len(str(d)) * len(value))
            elif name == "replace" and len(rest) >= 2:
                s, old, new = str(value), str(rest[0]), str(rest[1])
                _check_size(what, len(s) + (s.count(old) if old else len(s) + 1) * max(len(new) - len(old), 0))
            elif name == "format" and isinstance(value, str):
                _check_printf(value, rest or kwargs)
            elif name == "pprint":
                _check_size(what, 2 * size)
            return function(*head, value, *rest, **kwargs)

        return bounded


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in a BoundedSandbox (cached: a chat template is compiled once, rendered often)."""
    return BoundedSandbox().from_string(source)


# ------------------------------------------------------------------------------------------ rendering
def _template_name(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    source = template if isinstance(template, str) else repr(template)
    first_line = source.strip().splitlines()[0][:60] if source.strip() else ""
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'this tokenizer'} ({first_line!r}...)"


def _template_source(tokenizer) -> str:
    get = getattr(tokenizer, "get_chat_template", None)
    return get() if callable(get) else tokenizer.chat_template  # a dict of named templates: its "default"


def _plain(value):
    """What a template may see, as transformers gives it: JSON types rebuilt, anything else a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _template_messages(conversation) -> list[dict]:
    """The messages as transformers passes them: keys whose value is None dropped, and a message's reasoning
    also under `thinking` and `reasoning_content`, the names templates read."""
    messages = []
    for message in conversation:
        message = {key: _plain(value) for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def render_chat_template(tokenizer, conversation, add_generation_prompt: bool = True,
                         deadline_s: float = RENDER_DEADLINE_S) -> str:
    """The conversation as text, through the tokenizer's chat template, with the prompt that opens the
    assistant's turn (as vLLM and `LLM.chat` render it): the text `tokenizer.apply_chat_template` gives.
    Refuses a template that fails, asks for too large a value, or runs past deadline_s."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat needs a tokenizer with a chat template; this checkpoint has none")
    check_conversation(conversation)
    messages = _template_messages(conversation)
    limit = max(RENDER_MIN_CHARS, 4 * text_size(messages, sys.maxsize))
    variables = {**_plain(dict(getattr(tokenizer, "special_tokens_map", {}))), "messages": messages,
                 "tools": None, "documents": None, "add_generation_prompt": add_generation_prompt}
    stop_at = time.monotonic() + deadline_s

    def tick(frame, event, arg):  # the trace function of every frame the render runs: each line checks the clock
        if time.monotonic() > stop_at:
            raise _Overdue
        return None if frame.f_code is _UNTRACED else tick  # text_size is bounded: its lines go untraced

    token = _limit.set(limit)
    outer = sys.gettrace()  # a debugger's or coverage's tracer, restored afterwards
    sys.settrace(tick)
    try:
        pieces, length = [], 0
        for piece in compile_chat_template(_template_source(tokenizer)).generate(**variables):
            length += len(piece)
            if length > limit:
                raise TemplateTooLarge(f"its output passed {limit:,} characters, the most a chat template may build")
            pieces.append(piece)
        return "".join(pieces)
    except _Overdue:
        raise ValueError(f"{_template_name(tokenizer)} did not finish rendering within {deadline_s:g} s: "
                         f"refused (a template that loops without bound)") from None
    except TemplateTooLarge as error:
        raise ValueError(f"{_template_name(tokenizer)} was refused: {error}") from None
    except Exception as error:  # jinja2's errors, raise_exception() in the template, a missing variable
        raise ValueError(f"{_template_name(tokenizer)} failed to render: {type(error).__name__}: {error}") from error
    finally:
        sys.settrace(outer)
        _limit.reset(token)


def chat_token_ids(tokenizer, conversation, add_generation_prompt: bool = True) -> list[int]:
    """The token ids the engine sees for a conversation: the rendered template already holds the special
    tokens it wants, so the tokenizer adds none."""
    text = render_chat_template(tokenizer, conversation, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def chat_prompts(tokenizer, conversations) -> list[list[int]]:
    """`LLM.chat`: the token ids of each conversation, all checked before any is rendered."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("LLM.chat needs a tokenizer with a chat template; this checkpoint has none")
    for i, conversation in enumerate(conversations):
        check_conversation(conversation, f"messages[{i}]")
    return [chat_token_ids(tokenizer, conversation) for conversation in conversations]
