"""Budgets for rendering a chat template: code that came with a tokenizer, run on every record.

jinja2's sandbox keeps a template away from files and Python's internals, not from memory or time:
`'%999999999s' % 'x'`, `'x' * 10**10`, `'{:>9999999999}'.format('x')` or `'x'|center(9999999999)` allocate
gigabytes in one operation, and two nested `range(100000)` loops run for hours. A template compiled by
`compile_budgeted` prices, before it runs, each operation through which it can build a value: the
operators `+ * % **`, each call (of a method, a global, a macro), each filter, each `{{ }}`, piece of
text and `~` it writes. Against the environment's Budget:

- chars: no value may be larger (it is refused before it is allocated), nor the rendered text; and all
  the values one rendering builds may not add up to more than WORK_FACTOR times as much;
- iterations: loop iterations and calls in one rendering (two nested range(100000) loops stop here,
  after the same number of steps on any machine); depth: calls inside calls (a macro calling itself);
- seconds: the clock, checked at each of these steps and at each attribute or item read, for the
  renderings of one record together (Budget.start_record).

Sizes are counted in characters: a string its length, a container what its items print as (an item
held twice counts twice, as it prints twice), so a price is within a small factor of the bytes (quotes,
escapes). A refusal is BudgetError, naming the limit and what reached it.
"""
from __future__ import annotations

import math
import re
import string
import sys
import time
from collections.abc import Mapping, MappingView
from dataclasses import dataclass, field

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, pass_context

WORK_FACTOR = 16  # a template builds each piece of its text a few times (concatenation, filters)
CLOCK_EVERY = 255  # the clock is read every 256th step: a step takes microseconds, reading the clock a tenth of one
TEXT, LOOP = "hpctrain_priced_text", "hpctrain_priced_loop"  # filters the compiler puts in: written text, loops
CONTAINERS = (list, tuple, set, frozenset, Mapping, MappingView, Namespace)
OPERATOR = {op: f"the {op} operator" for op in ("+", "*", "%", "**")}
# Multiplying numbers of millions of digits takes seconds and cannot be interrupted: a template's numbers stay
# within what Python prints (its int-to-text limit).
INT_DIGITS = getattr(sys, "get_int_max_str_digits", lambda: 4300)() or 4300


class BudgetError(Exception):
    """A rendering that went past its Budget; `flag`: the prepare option that raises that limit (or None)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


@dataclass
class Budget:
    seconds: float = 10.0  # per record: all the renderings of its conversation (prepare --render-seconds)
    chars: int = 16_000_000  # per value and per rendered text (prepare --render-mb)
    iterations: int = 1_000_000  # loop iterations and calls, per rendering
    depth: int = 64  # calls inside calls
    _deadline: float = field(default=math.inf, repr=False)
    _steps: int = field(default=0, repr=False)
    _work: int = field(default=0, repr=False)
    _depth: int = field(default=0, repr=False)
    _ticks: int = field(default=0, repr=False)

    def start_record(self) -> None:
        self._deadline = time.monotonic() + self.seconds

    def start_render(self) -> None:
        self._steps = self._work = self._depth = 0

    def tick(self) -> None:
        """One more step of any kind: the clock is read every CLOCK_EVERY + 1 of them."""
        self._ticks += 1
        if not self._ticks & CLOCK_EVERY and time.monotonic() > self._deadline:
            raise BudgetError(f"the record took more than {self.seconds:g} s to render", "--render-seconds")

    def step(self, n: int = 1) -> None:
        self._steps += n
        if self._steps > self.iterations:
            raise BudgetError(f"more than {self.iterations:,} loop iterations and calls in one rendering (loops "
                              f"nested over large ranges?)")
        self.tick()

    def build(self, chars: int, what) -> None:
        """`what` (a text, or a function that makes it: only a refusal needs it) is about to build a value
        of `chars` characters."""
        self._work += chars
        if chars > self.chars:
            raise BudgetError(f"{_text(what)} would build {chars:,} characters, more than the {self.chars:,} "
                              f"allowed", "--render-mb")
        if self._work > WORK_FACTOR * self.chars:
            raise BudgetError(f"the values built in one rendering add up to more than {WORK_FACTOR} x "
                              f"{self.chars:,} characters (at {_text(what)})", "--render-mb")
        self.tick()

    def enter(self) -> None:
        self._depth += 1
        if self._depth > self.depth:
            raise BudgetError(f"calls nest more than {self.depth} deep (a macro that calls itself without end?)")

    def leave(self) -> None:
        self._depth -= 1


def _text(what) -> str:
    return what if isinstance(what, str) else what()


def size(value) -> int:
    """The characters `value` prints as, about: containers by their items, each time it holds one (a list
    of one string a million times is a million strings long). Linear in the distinct objects it holds."""
    if type(value) is str:  # the usual case, first: the ABCs of CONTAINERS are slow to test against
        return len(value)
    if not isinstance(value, CONTAINERS):
        return _scalar(value)
    memo: dict[int, int] = {}
    stack = [(value, False)]
    while stack:
        v, expanded = stack.pop()
        if id(v) in memo and not expanded:
            continue
        kids = _items(v)
        if expanded:
            memo[id(v)] = 2 + sum(memo.get(id(k), 5) if isinstance(k, CONTAINERS) else _scalar(k) + 2 for k in kids)
            continue
        memo[id(v)] = 5  # while its items are counted: a container that holds itself prints as '...'
        stack.append((v, True))
        stack.extend((k, False) for k in kids if isinstance(k, CONTAINERS) and id(k) not in memo)
    return memo[id(value)]


def _items(v) -> list:
    if isinstance(v, Namespace):
        v = getattr(v, "_Namespace__attrs", {})
    if isinstance(v, Mapping):
        return [*v.keys(), *v.values()]
    return list(v)


def _scalar(v) -> int:
    if isinstance(v, str):
        return len(v)
    if isinstance(v, int):
        return _digits(v)
    return 0 if isinstance(v, jinja2.Undefined) else 24  # a float, None, an object's repr


def _digits(n: int) -> int:
    return int(abs(n).bit_length() * 0.30103) + 2


def _whole(v, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


def printf_size(fmt: str, args) -> int:
    """An upper bound, about, of `fmt % args`: its text, each conversion's width and precision, the arguments."""
    n = len(fmt) + size(args)
    for width, precision in _PRINTF.findall(fmt):
        n += sum(int(x) for x in (width, precision) if x.isdigit())
        if "*" in (width, precision):  # a width taken from the arguments
            n += sum(_whole(a) for a in (args if isinstance(args, tuple) else (args,)))
    return n


def format_size(fmt: str, args, kwargs) -> int:
    """An upper bound, about, of `fmt.format(*args, **kwargs)`."""
    n = len(fmt) + size(args) + size(kwargs)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:  # format() refuses it
        return n
    for _, _, spec, _ in fields:
        if spec:
            n += sum(int(d) for d in re.findall(r"\d+", spec))
            if "{" in spec:  # a width taken from the arguments
                n += sum(_whole(a) for a in (*args, *kwargs.values()))
    return n


def replace_size(s: str, old, new, count=-1) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    return len(s) + (min(hits, count) if _whole(count, -1) >= 0 else hits) * max(len(new) - len(old), 0)


def binop_size(op: str, a, b) -> int:
    """What `a op b` builds, before it is computed: the length of a string or list, an integer's digits."""
    if type(a) is str and type(b) is str:  # the usual case, first
        return len(a) + len(b) if op == "+" else printf_size(a, b) if op == "%" else 0
    if op == "+" and isinstance(a, (str, list, tuple)) and isinstance(b, (str, list, tuple)):
        return len(a) + len(b)
    if op == "*":
        seq, n = (b, a) if isinstance(a, int) else (a, b)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            return len(seq) * max(n, 0)
        if isinstance(a, int) and isinstance(b, int):
            return _digits(a) + _digits(b)
    if op == "%" and isinstance(a, str):
        return printf_size(a, b)
    if op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        return int(b * math.log10(abs(a))) + 1
    return 0


WIDTH_METHODS = ("center", "ljust", "rjust", "zfill")


def call_size(obj, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """(what calling obj(*args, **kwargs) builds, about; the arguments to call it with: an iterator given to
    join is read into a list first, to count it)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox's wrapper of str.format
    s, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if isinstance(s, str):
        if name == "format":
            return format_size(s, args, kwargs), args
        if name == "format_map":
            return format_size(s, (), args[0] if args and isinstance(args[0], Mapping) else {}), args
        if name in WIDTH_METHODS:
            return max(len(s), _whole(args[0] if args else kwargs.get("width"))), args
        if name == "expandtabs":
            return len(s) + s.count("\t") * _whole(args[0] if args else kwargs.get("tabsize"), 8), args
        if name == "replace":
            return replace_size(s, *args[:3]), args
        if name == "join" and args:
            items = list(args[0])
            return sum(size(i) for i in items) + len(s) * len(items), (items, *args[1:])
        if name == "translate" and args and isinstance(args[0], Mapping):
            return len(s) * max([1, *(size(v) for v in args[0].values())]), args
        return 3 * len(s), args  # upper(), split(), ...: a few characters per character at most
    if name == "generate_lorem_ipsum":  # the lipsum global: n paragraphs of up to max words
        n = _whole(args[0] if args else kwargs.get("n"), 5)
        most = _whole(args[3] if len(args) > 3 else kwargs.get("max"), 100)
        return max(n, 0) * max(most, 0) * 16, args
    return 0, args


# Filters that do not turn their input into text: priced by its length, not by what it prints as.
SHALLOW_FILTERS = frozenset({
    "length", "count", "first", "last", "default", "d", "int", "float", "abs", "attr", "items", "dictsort",
    "selectattr", "rejectattr", "select", "reject", "map", "unique", "min", "max", "sort", "reverse", "list", "batch",
    "slice", "groupby", "random", "sum", "round", "wordcount"})


def filter_size(name: str, value, args: tuple, kwargs: dict) -> tuple[int, object]:
    """(what the filter `name` builds from value and its arguments, about; the value to give it: an
    iterator given to join is read into a list first, to count it)."""
    if name in ("join", "sum") and not isinstance(value, (str, jinja2.Undefined, *CONTAINERS)):
        value = list(value)  # an iterator (a filter's result): read once here, to be counted
    if name == "join" and isinstance(value, (list, tuple)):
        sep = args[0] if args else kwargs.get("d", "")
        return sum(size(i) for i in value) + len(sep if isinstance(sep, str) else "") * len(value), value
    base = (len(value) if hasattr(type(value), "__len__") else 0) if name in SHALLOW_FILTERS else size(value)
    arg = lambda i, key, default=None: args[i] if len(args) > i else kwargs.get(key, default)  # noqa: E731
    if name == "center":
        return max(base, _whole(arg(0, "width", 80))), value
    if name == "indent":
        width = arg(0, "width", 4)
        per_line = len(width) if isinstance(width, str) else _whole(width)
        return base + (str(value).count("\n") + 1 if isinstance(value, str) else base) * per_line, value
    if name == "replace" and isinstance(value, str):
        return replace_size(value, arg(0, "old"), arg(1, "new"), arg(2, "count", -1)), value
    if name == "format" and isinstance(value, str):
        return printf_size(value, kwargs or args), value
    if name == "wordwrap":
        wrap = arg(2, "wrapstring") or "\n"
        return base * (1 + (len(wrap) if isinstance(wrap, str) else 1)), value
    if name in ("batch", "slice"):
        return base + _whole(arg(0, "linecount" if name == "batch" else "slices")), value
    if name == "sum" and isinstance(value, (list, tuple)):  # lists added one by one: each sum copies the last
        return len(value) * sum(len(v) for v in value if isinstance(v, (str, list, tuple))), value
    if name == "tojson":
        return 6 * base * (1 + _whole(arg(1, "indent"))), value  # \uXXXX escapes; indentation per item
    return base, value


INTERNAL_KWARGS = ("_loop_vars", "_block_vars", "caller")  # what jinja2 passes along with a call: not arguments


def _priced_filter(name: str, f):
    pass_arg = _PassArg.from_obj(f)

    # pass_context also keeps the compiler from running the filter on constants at compile time, unpriced.
    @pass_context
    def priced(context, value, *args, **kwargs):
        budget = context.environment.budget
        chars, value = filter_size(name, value, args, kwargs)
        budget.build(chars, what)
        first = {_PassArg.context: (context,), _PassArg.eval_context: (context.eval_ctx,),
                 _PassArg.environment: (context.environment,)}.get(pass_arg, ())
        result = f(*first, value, *args, **kwargs)
        if isinstance(result, (str, list, tuple)):  # what nothing above foresaw still counts
            budget.build(len(result), what)
        return result

    what = f"the {name} filter"
    priced.hpctrain_priced = True
    return priced


@pass_context
def _loop_filter(context, value):
    """A loop's iterable, its iterations counted: all at once where it has a length, else one by one."""
    budget = context.environment.budget
    try:
        n = len(value)
    except TypeError:  # an iterator (a filter's result)
        return _stepped(value, budget)
    budget.step(n)
    return value


def _stepped(iterable, budget: Budget):
    for item in iterable:
        budget.step()
        yield item


@pass_context
def _text_filter(context, value):
    context.environment.budget.build(size(value), "writing a value")
    return value


_loop_filter.hpctrain_priced = _text_filter.hpctrain_priced = True


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' environment (ImmutableSandboxedEnvironment) with every growth priced against `budget`."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})  # also keeps them from being folded at compile time

    def __init__(self, *args, budget: Budget | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.budget = budget or Budget()

    def call_binop(self, context, operator, left, right):
        chars = binop_size(operator, left, right)
        if operator in ("*", "**") and type(left) is int and type(right) is int and chars > INT_DIGITS:
            raise BudgetError(f"the {operator} operator would build a number of {chars:,} digits, more than Python "
                              f"prints ({INT_DIGITS:,})")
        self.budget.build(chars, OPERATOR[operator])
        return self.binop_table[operator](left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own signature)
        budget = __self.budget
        budget.step()
        chars, args = call_size(__obj, args, {k: v for k, v in kwargs.items() if k not in INTERNAL_KWARGS})
        what = lambda: f"a call of {getattr(__obj, '__name__', type(__obj).__name__)}"  # noqa: E731
        budget.build(chars, what)
        budget.enter()
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.leave()
        if isinstance(result, (str, list, tuple)):  # what nothing above foresaw still counts
            budget.build(len(result), what)
        return result

    def getattr(self, obj, attribute):
        self.budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.budget.tick()
        return super().getitem(obj, argument)


def compile_budgeted(env: BudgetedEnvironment, source: str) -> jinja2.Template:
    """`source` compiled in `env`, its loops, written values and filters priced (TemplateSyntaxError as
    env.from_string raises it)."""
    ast = env.parse(source)
    for node in list(ast.find_all(nodes.For)):
        node.iter = nodes.Filter(node.iter, LOOP, [], [], None, None, lineno=node.lineno)
    for node in list(ast.find_all((nodes.Output, nodes.Concat))):
        node.nodes = [nodes.Filter(n, TEXT, [], [], None, None, lineno=n.lineno) for n in node.nodes]
    ast.set_environment(env)
    env.filters = {name: f if getattr(f, "hpctrain_priced", False) else _priced_filter(name, f)
                   for name, f in env.filters.items()}
    env.filters[LOOP], env.filters[TEXT] = _loop_filter, _text_filter
    return env.from_string(ast)


def render(template: jinja2.Template, budget: Budget, **variables) -> str:
    """template.render(**variables) within `budget` (BudgetError past it)."""
    budget.start_render()
    out, n = [], 0
    for piece in template.generate(**variables):
        n += len(piece)
        if n > budget.chars:
            raise BudgetError(f"the rendered text is longer than the {budget.chars:,} characters allowed",
                              "--render-mb")
        out.append(piece)
    return "".join(out)
