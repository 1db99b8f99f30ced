"""The installed `sglang` package (pinned, installed without its dependencies: see
requirements-sglang.txt) as the judge of what the SGLang engine sends and reads.

`import sglang` needs triton and CUDA-only packages, so nothing here imports the package as a
whole: a module whose own imports are light (the /generate schema `sglang.api.v1.api_types`,
`sglang.srt.sampling.sampling_params`, `sglang.srt.weight_sync.tensor_bucket`,
`sglang.srt.utils.msgspec_utils`,
`sglang.srt.arg_groups.arg_utils`) is loaded from its file under bare parent packages, so that
sglang's `__init__` files do not run. What lives in a module that needs CUDA to import (the
routes in `http_server.py`, the request types in `io_struct.py`, the launch flags, the
admission checks in `tokenizer_manager.py`) is read from its source with `ast`; a fact that
can no longer be found raises `FactMissing`, so an sglang upgrade that moves it fails the
contract test rather than passing it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import sys
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

PINNED = "0.5.23"
"""The sglang release the contract is checked against (requirements-sglang.txt)."""


class FactMissing(AssertionError):
    """A fact about sglang's source that the contract relies on was not found."""


class ContractBroken(AssertionError):
    """Something the engine sends or reads breaks sglang's contract."""


@cache
def root() -> Path:
    """The installed package's directory; FactMissing when sglang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise FactMissing(
            f"sglang is not installed: pip install --no-deps sglang=={PINNED} "
            "(make venv does, from requirements-sglang.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def version() -> str:
    return importlib.metadata.version("sglang")


def load(module: str) -> types.ModuleType:
    """Import `module` (e.g. "sglang.api.v1.api_types") without running the `__init__` of
    the packages above it."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            path = str(root().joinpath(*parts[1:i]))
            package = types.ModuleType(name)
            package.__path__ = [path]
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            package.__spec__.submodule_search_locations = [path]
            sys.modules[name] = package
    return importlib.import_module(module)


@cache
def tree(relative: str) -> ast.Module:
    path = root() / relative
    if not path.is_file():
        raise FactMissing(f"sglang {version()}: no {relative}")
    return ast.parse(path.read_text(), filename=str(path))


def find_def(relative: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef:
    """The first function or class called `name` in sglang's `relative` source file."""
    for node in ast.walk(tree(relative)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return node
    raise FactMissing(f"sglang {version()}: no {name} in {relative}")


def source_of(relative: str, node: ast.AST) -> str:
    return ast.get_source_segment((root() / relative).read_text(), node) or ""


# ------------------------------------------------------------------------- routes
HTTP_SERVER = "srt/entrypoints/http_server.py"
IO_STRUCT = "srt/managers/io_struct.py"


@cache
def routes() -> dict[str, tuple[str, str | None]]:
    """path -> (handler name, the request type its body is parsed into, or None)."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in tree(HTTP_SERVER).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Attribute)
                and deco.func.attr in ("get", "post", "api_route")
                and deco.args
                and isinstance(deco.args[0], ast.Constant)
            ):
                out[deco.args[0].value] = (node.name, _body_type(node))
    if "/generate" not in out:
        raise FactMissing(f"sglang {version()}: no routes found in {HTTP_SERVER}")
    return out


def _body_type(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """`obj: X` or `obj: Annotated[X, Body()]` -> "X"."""
    for arg in fn.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        if isinstance(ann, ast.Name) and ann.id not in ("Request", "str", "int", "float"):
            return ann.id
    return None


def route(path: str) -> tuple[str, str | None]:
    if path not in routes():
        raise FactMissing(f"sglang {version()}: no route {path} in {HTTP_SERVER}")
    return routes()[path]


# ------------------------------------------------------------------- io_struct types
_TYPING = {name: getattr(typing, name) for name in typing.__all__}


@cache
def struct_fields(name: str) -> dict[str, tuple[str, ast.expr | None]]:
    """Field -> (annotation source, default expression or None) of io_struct class `name`,
    its io_struct bases' fields included."""
    cls = find_def(IO_STRUCT, name)
    fields: dict[str, tuple[str, ast.expr | None]] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id not in ("object",):
            try:
                fields.update(struct_fields(base.id))
            except FactMissing:
                pass  # msgspec.Struct and the like
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = (source_of(IO_STRUCT, stmt.annotation), stmt.value)
    return fields


def evaluate(expr: str, what: str) -> Any:
    try:
        return eval(expr, {"__builtins__": __builtins__, **_TYPING})  # noqa: S307 - sglang's own source
    except Exception as exc:  # noqa: BLE001 - reported as a missing fact
        raise FactMissing(f"sglang {version()}: cannot evaluate {what} = {expr!r}: {exc}") from None


def request_type(name: str, sent: set[str]) -> type:
    """A msgspec Struct with the fields of io_struct class `name` (the annotations and
    defaults of the fields in `sent` evaluated; the others Any), parsed by sglang's own
    pydantic bridge (`msgspec_struct_pydantic_core_schema`), as FastAPI parses the body."""
    bridge = load("sglang.srt.utils.msgspec_utils").msgspec_struct_pydantic_core_schema
    spec = []
    for field, (annotation, default) in struct_fields(name).items():
        kind = evaluate(annotation, f"{name}.{field}") if field in sent else Any
        if default is None:
            spec.append((field, kind))
        elif field in sent:
            value = evaluate(ast.unparse(default), f"{name}.{field} default")
            spec.append((field, kind, value))
        else:
            spec.append((field, kind, None))

    def schema(cls, source, handler):  # as io_struct.BaseReq.__get_pydantic_core_schema__
        return bridge(cls, handler)

    return msgspec.defstruct(
        name, spec, kw_only=True, namespace={"__get_pydantic_core_schema__": classmethod(schema)}
    )


def check_control(path: str, body: dict | None) -> None:
    """`body` sent to `path` is what the route's io_struct type takes: every key one of its
    fields (the server ignores others: what we meant would be lost), the values parse."""
    from pydantic import TypeAdapter, ValidationError

    handler, type_name = route(path)
    if type_name is None:
        if body:
            raise ContractBroken(f"{path} ({handler}) takes no body, we send {body}")
        return
    if body is None:
        raise ContractBroken(f"{path} takes a {type_name} body (a 422 without one)")
    unknown = set(body) - set(struct_fields(type_name))
    if unknown:
        raise ContractBroken(f"{path}: {sorted(unknown)} are not fields of {type_name}")
    try:
        TypeAdapter(request_type(type_name, set(body))).validate_json(json.dumps(body))
    except ValidationError as exc:
        raise ContractBroken(f"{path}: {type_name} refuses {body}: {exc}") from None


# ------------------------------------------------------------------------- /generate
TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"


def api_types() -> types.ModuleType:
    return load("sglang.api.v1.api_types")


def sampling_module() -> types.ModuleType:
    return load("sglang.srt.sampling.sampling_params")


def tensor_bucket_module() -> types.ModuleType:
    """`FlattenedTensorBucket`, what `load_format: "flattened_bucket"` receives into."""
    return load("sglang.srt.weight_sync.tensor_bucket")


@cache
def admission() -> tuple[str, str]:
    """The comparison operators of tokenizer_manager's length checks: (prompt vs context,
    prompt + max_new_tokens vs context), e.g. (">=", ">") for "refused when ..."."""
    found: dict[str, str] = {}
    ops = {ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Lt: "<"}
    for node in ast.walk(tree(TOKENIZER_MANAGER)):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
            continue
        text = ast.unparse(node)
        if text.startswith("input_token_num") and "context_len" in text:
            found.setdefault("prompt", ops.get(type(node.ops[0]), "?"))
        elif "max_new_tokens + input_token_num" in text and "_max_req_len" in text:
            found.setdefault("total", ops.get(type(node.ops[0]), "?"))
    if set(found) != {"prompt", "total"}:
        raise FactMissing(
            f"sglang {version()}: the context checks of {TOKENIZER_MANAGER} "
            f"(input_token_num >= context_len, max_new_tokens + input_token_num > _max_req_len) "
            f"were not found (found {found})"
        )
    return found["prompt"], found["total"]


def admits(prompt_len: int, max_new: int, context: int) -> bool:
    """Whether the server takes a request of these lengths (no --allow-auto-truncate)."""
    refused = {">=": int.__ge__, ">": int.__gt__, "<=": int.__le__, "<": int.__lt__}
    prompt_op, total_op = admission()
    return not (
        refused[prompt_op](prompt_len, context) or refused[total_op](prompt_len + max_new, context)
    )


def check_generate(body: dict, tokenizer: Any, vocab_size: int, context: int) -> None:
    """`body` passes what /generate does before it schedules a request: the schema
    (api_contract.generate_contract_error -> api_types.GenerateRequest), SamplingParams'
    normalize + verify (tokenizer_manager._create_tokenized_object) and the context checks."""
    api = api_types()
    try:
        api.GenerateRequest.from_json_value(body)
    except api.JsonContractError as exc:
        raise ContractBroken(f"/generate schema refuses the body: {exc}") from None
    known = {f.name for f in msgspec.structs.fields(api.GenerateRequest)}
    if set(body) - known:
        raise ContractBroken(f"/generate ignores {sorted(set(body) - known)}")
    try:
        params = sampling_module().SamplingParams(**body.get("sampling_params", {}))
        params.normalize(tokenizer)
        params.verify(vocab_size)
    except (ValueError, TypeError) as exc:
        raise ContractBroken(f"/generate SamplingParams refuses the body: {exc}") from None
    max_new = body.get("sampling_params", {}).get("max_new_tokens", 128)
    if not admits(len(body["input_ids"]), max_new, context):
        raise ContractBroken(
            f"/generate: {len(body['input_ids'])} prompt + {max_new} new tokens do not fit "
            f"a context of {context}"
        )


# ------------------------------------------------------------------------- launch argv
SERVER_ARGS = "srt/server_args.py"


@cache
def launch_field(name: str) -> tuple[str, ast.expr | None, str]:
    """(annotation source, default, the file declaring it) of ServerArgs field `name`, from
    the input namespace classes `server_args._INPUT_NAMESPACES` names
    (sglang/srt/arg_groups/fields/*.py)."""
    namespaces: list[str] = []
    for node in tree(SERVER_ARGS).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(getattr(t, "id", "") == "_INPUT_NAMESPACES" for t in targets):
                namespaces = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    if not namespaces:
        raise FactMissing(f"sglang {version()}: no _INPUT_NAMESPACES in {SERVER_ARGS}")
    for path in sorted((root() / "srt/arg_groups/fields").glob("*.py")):
        relative = str(path.relative_to(root()))
        for cls in tree(relative).body:
            if isinstance(cls, ast.ClassDef) and cls.name in namespaces:
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", "") == name:
                        return source_of(relative, stmt.annotation), stmt.value, relative
    raise FactMissing(f"sglang {version()}: no launch option {name} in {namespaces}")


def parse_launch_args(argv: list[str], fields: list[str]) -> dict[str, Any]:
    """`argv` (the flags after `-m sglang.launch_server`) parsed by the argparse options
    sglang's own `add_cli_args_from_dataclass` derives from the declarations of `fields`;
    ContractBroken when it refuses them."""
    import argparse

    arg_utils = load("sglang.srt.arg_groups.arg_utils")
    namespace = {**_TYPING, **vars(arg_utils)}
    spec = []
    for name in fields:
        annotation, default, relative = launch_field(name)
        namespace.update(imported_constants(relative))
        try:
            kind = eval(annotation, namespace)  # noqa: S307 - sglang's own source
            value = msgspec.NODEFAULT if default is None else eval(ast.unparse(default), namespace)  # noqa: S307
        except Exception as exc:  # noqa: BLE001 - reported as a missing fact
            raise FactMissing(
                f"sglang {version()}: cannot evaluate launch option {name}: {exc}"
            ) from None
        spec.append((name, kind) if value is msgspec.NODEFAULT else (name, kind, value))
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    arg_utils.add_cli_args_from_dataclass(parser, msgspec.defstruct("Launch", spec, kw_only=True))
    try:
        args, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ContractBroken(f"sglang.launch_server refuses {argv}: {exc}") from None
    if unknown:
        raise ContractBroken(f"sglang.launch_server: unknown options {unknown}")
    return vars(args)


def imported_constants(relative: str) -> dict[str, Any]:
    """The UPPER_CASE names `relative` imports from other sglang modules, where the module
    assigns them a literal (read from its source: sglang.srt.utils.common needs GPU-only
    packages to import), e.g. SUPPORTED_LORA_TARGET_MODULES for `--lora-target-modules`."""
    found: dict[str, Any] = {}
    for node in tree(relative).body:
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("sglang."):
            continue
        source = node.module.removeprefix("sglang.").replace(".", "/") + ".py"
        wanted = {a.name for a in node.names if a.name.isupper()}
        for stmt in tree(source).body if wanted else ():
            targets = stmt.targets if isinstance(stmt, ast.Assign) else []
            for t in targets:
                if getattr(t, "id", "") in wanted:
                    try:
                        found[t.id] = ast.literal_eval(stmt.value)
                    except ValueError:
                        pass  # not a literal: left out, the evaluation names what is missing
    return found


# ------------------------------------------------------------------------- facts
def calls_in(relative: str, function: str) -> str:
    """The source of `function` in sglang's `relative` file."""
    return source_of(relative, find_def(relative, function))


def require(fact: bool, message: str) -> None:
    if not fact:
        raise FactMissing(f"sglang {version()}: {message}")
