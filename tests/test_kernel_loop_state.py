"""Pipeline states advanced inside helpers come back to the loop that carries them.

The DSL turns a `cutlass.range` loop (and a run-time `if`) into a region whose carried values are
the names its body assigns or calls a method of (`state.advance()` in the body itself). A helper
that advances a state it was passed changes a Python object the loop does not carry: at the next
step the state is back where the loop last saw it. In the sm_90 backward that released the same
(Q, dO) stage at every step and the producer waited forever for the other one (the 64-row tile of
head dim 64, from ad107b7, whose `skip_hidden` option moved the release into a helper, until
133f81c). The rule checked here, over the kernel sources (the modules of a directory read together:
a kernel class takes helpers from its siblings' mixins): a function that advances a parameter
(itself, or through a helper) returns it, and every call of it assigns the returned state back
to the name it passed.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

KERNELS = Path(__file__).parent.parent / "cute_flash" / "kernels"


def _params(fn: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if names[:1] == ["self"] else names


def _callee(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
        return f.attr
    return f.id if isinstance(f, ast.Name) else None


def _functions(trees: list[ast.Module]) -> tuple[list, dict[str, list[str]]]:
    """The functions of `trees` and each name's parameters (the first function of a name)."""
    fns = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    params_of: dict[str, list[str]] = {}
    for fn in fns:
        params_of.setdefault(fn.name, _params(fn))
    return fns, params_of


def _advanced_args(call: ast.Call, adv: dict[str, set[str]], params_of: dict[str, list[str]]) -> set[str]:
    """The names `call` passes where its callee takes a parameter it advances (none through `*args`)."""
    callee = _callee(call)
    if callee not in adv or any(isinstance(a, ast.Starred) for a in call.args):
        return set()
    return {arg.id for name, arg in zip(params_of[callee], call.args)
            if name in adv[callee] and isinstance(arg, ast.Name)}


def _returned_names(fn: ast.FunctionDef, adv: dict[str, set[str]], params_of: dict[str, list[str]]) -> set[str]:
    """The names `fn` returns, directly or as the result of a call that advances and returns them."""
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for v in values:
                if isinstance(v, ast.Name):
                    names.add(v.id)
                elif isinstance(v, ast.Call):
                    names |= _advanced_args(v, adv, params_of)
    return names


def advanced_params(trees: list[ast.Module]) -> dict[str, set[str]]:
    """Function name -> the parameters it advances, directly (`p.advance()`) or by passing them to
    a function that does (functions of the same name are merged)."""
    fns, params_of = _functions(trees)
    adv: dict[str, set[str]] = {}
    changed = True
    while changed:
        changed = False
        for fn in fns:
            params = _params(fn)
            found = set(adv.get(fn.name, set()))
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                f = call.func
                if (isinstance(f, ast.Attribute) and f.attr == "advance" and isinstance(f.value, ast.Name)
                        and f.value.id in params):
                    found.add(f.value.id)
                found |= _advanced_args(call, adv, params_of) & set(params)
            if found != adv.get(fn.name, set()):
                adv[fn.name] = found
                changed = True
    return {k: v for k, v in adv.items() if v}


def lost_advances(*sources: str) -> list[str]:
    """Where `sources`, read together (a kernel class and the mixins of its sibling modules), break
    the rule, one line each."""
    trees = [ast.parse(source) for source in sources]
    adv = advanced_params(trees)
    fns, params_of = _functions(trees)
    problems = []
    for fn in fns:
        for p in sorted(adv.get(fn.name, set()) - _returned_names(fn, adv, params_of)):
            problems.append(f"{fn.name} advances its parameter {p} but does not return it")
    for fn in fns:
        for stmt in ast.walk(fn):
            value = getattr(stmt, "value", None)
            if not (isinstance(value, ast.Call) and _callee(value) in adv):
                continue
            callee = _callee(value)
            if isinstance(stmt, ast.Expr):
                problems.append(f"{fn.name}, line {stmt.lineno}: the state {callee} advances is dropped")
            elif isinstance(stmt, ast.Assign):
                targets = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                for name in sorted(_advanced_args(value, adv, params_of) - targets):
                    problems.append(f"{fn.name}, line {stmt.lineno}: {name} passed to {callee} is not assigned back")
    return problems


def test_kernel_sources_return_the_states_their_helpers_advance():
    # each directory's modules together: a kernel class takes helpers from its siblings' mixins
    packages: dict[Path, list[str]] = {}
    for path in sorted(KERNELS.rglob("*.py")):
        packages.setdefault(path.parent, []).append(path.read_text())
    # not vacuous: the scan reads the kernels whose loops advance pipeline states
    assert sum(text.count(".advance()") for texts in packages.values() for text in texts) >= 10
    problems = [f"{package.relative_to(KERNELS.parent)}: {p}" for package, texts in packages.items()
                for p in lost_advances(*texts)]
    assert problems == []


DEADLOCKED = """
class K:
    def consume(self, pipeline_q):
        release_state = make_pipeline_state()
        for it in cutlass.range(steps, unroll=1):
            tick = self.step_front(it, pipeline_q, release_state)

    def step_front(self, it, pipeline_q, release_state):
        self.release_previous_stage(it, pipeline_q, release_state)
        return tick

    def release_previous_stage(self, it, pipeline_q, release_state):
        if it > 0:
            pipeline_q.consumer_release(release_state)
            release_state.advance()
"""


def test_the_deadlocked_form_is_caught():
    assert lost_advances(DEADLOCKED) == [
        "step_front advances its parameter release_state but does not return it",
        "release_previous_stage advances its parameter release_state but does not return it",
        "consume, line 6: release_state passed to step_front is not assigned back",
        "step_front, line 9: the state release_previous_stage advances is dropped",
    ]


def test_a_helper_in_a_sibling_module_is_followed():
    """The deadlocked form with the helpers in a mixin's module, read with the kernel class's."""
    kernel, helpers = DEADLOCKED.split("    def step_front")
    mixin = "class Mixin:\n    def step_front" + helpers
    assert lost_advances(kernel) == []
    assert lost_advances(kernel, mixin) == [
        "step_front advances its parameter release_state but does not return it",
        "release_previous_stage advances its parameter release_state but does not return it",
        "consume, line 6: release_state passed to step_front is not assigned back",
        "step_front, line 3: the state release_previous_stage advances is dropped",
    ]


def test_a_returned_state_must_also_be_assigned_back():
    source = textwrap.dedent("""
        def helper(state):
            state.advance()
            return state

        def loop():
            state = make_state()
            other = helper(state)
            state = helper(state)
            tick, state = helper(state), 0
    """)
    assert lost_advances(source) == ["loop, line 8: state passed to helper is not assigned back"]


def test_clones_advanced_and_returned_pass():
    """The sm_90 forward's form: a helper advances a clone of its argument and returns it."""
    source = textwrap.dedent("""
        def pv_block(self, kv, pipeline_v):
            pipeline_v.consumer_release(kv)
            kv_next = kv.clone()
            kv_next.advance()
            return kv_next

        def consume(self, kv, pipeline_v):
            for it in cutlass.range(n):
                kv = self.pv_block(kv, pipeline_v)
    """)
    assert lost_advances(source) == []
