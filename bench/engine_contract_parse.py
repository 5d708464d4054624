"""Parses command lines with an installed engine's own parser (vLLM's or SGLang's).

Run by :mod:`bench.engine_contract` with the engine's interpreter, by path: that
environment has the engine and not modelkeeper, so this imports only the standard library
at the top. It reads a JSON request on stdin::

    {"engine": "vllm" | "sglang", "lines": [{"id": "...", "argv": [...]}, ...],
     "describe": ["--dtype", ...]}

where each ``argv`` is what follows the interpreter on our launch plan's command line, and
writes one JSON object on stdout: the versions installed, each line's verdict, the
choices the parser offers for each flag in ``describe``, and what the plans rely on
besides flags (the entry points they run, the environment variables they set).

Each line is parsed the way the engine's entry point parses it:

- vLLM (``python -m vllm.entrypoints.cli.main serve ...``): the CLI's ``serve``
  subparser, ``make_arg_parser`` (vllm/entrypoints/common/cli_args.py) on a
  ``FlexibleArgumentParser``, then ``validate_parsed_serve_args`` and
  ``AsyncEngineArgs.from_cli_args``, as vllm/entrypoints/cli/main.py and
  vllm/entrypoints/cli/serve.py do before anything loads.
- SGLang (our entry script, :mod:`agent.engines.sglang_main`): ``prepare_server_args``
  (sglang/srt/server_args.py: ``ServerArgs.add_cli_args`` on an argparse parser, then
  ``ServerArgs.from_cli_args``), as ``python -m sglang.launch_server`` does.

Neither needs a GPU: the checks that need one (``create_engine_config``, SGLang's
``resolve_once``, which read the model's config) are left out, and the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: What the vLLM plan runs after the interpreter: the CLI's module, then its subcommand.
VLLM_ENTRY = ["-m", "vllm.entrypoints.cli.main", "serve"]
#: The last lines of an error kept in a verdict: argparse's message is one line, a
#: validation error's last line names it.
ERROR_CHARS = 600


def _error_text(output: str, exc: BaseException | None) -> str:
    """The parser's complaint: argparse's last line, or the exception raised."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    if exc is not None and not isinstance(exc, SystemExit):
        text = f"{type(exc).__name__}: {exc}"
    return _plain(text)


def _plain(text: str) -> str:
    """``text`` without terminal colour codes or a leading timestamp, on one line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    text = re.sub(r"^\s*\[\d{4}-\d\d-\d\d [\d:]+\]\s*", "", text)
    return " ".join(text.split())[:ERROR_CHARS]


#: Lines the engine writes while parsing that are worth a report: deprecations and
#: warnings (a deprecated flag), not its progress chatter.
_WORTH_REPORTING = re.compile(r"deprecat|warn", re.IGNORECASE)


@contextlib.contextmanager
def _fd_captured() -> Iterator[Callable[[], str]]:
    """Everything written to file descriptors 1 and 2 inside, whoever writes it: the
    engines log through handlers bound to the streams they found at import."""
    with tempfile.TemporaryFile() as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        text: list[str] = []
        try:
            yield lambda: "".join(text)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


def _run(parse: Callable[[list[str]], Any], argv: list[str]) -> tuple[bool, str, list[str]]:
    """Parse ``argv``: whether it passed, the parser's complaint, and its warnings."""
    ok: bool = True
    exc: BaseException | None = None
    with _fd_captured() as output, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parse(argv)
        except SystemExit as stop:  # argparse's way of refusing a line
            ok, exc = stop.code in (0, None), stop
        # Broad: the engines' validators raise any type (ValueError, TypeError, pydantic's
        # ValidationError, AssertionError): each is that line's verdict, not a probe crash.
        except Exception as failure:  # noqa: BLE001
            ok, exc = False, failure
    if not ok:
        # Its usage text is no warning: the complaint is what matters.
        return False, _error_text(output(), exc), []
    said = [_plain(line) for line in output().splitlines() if _WORTH_REPORTING.search(line)]
    said += [_plain(str(w.message)) for w in caught]
    return True, "", sorted(set(said))


def _vllm() -> tuple[Callable[[list[str]], Any], argparse.ArgumentParser, dict[str, Any]]:
    # Without a GPU, vLLM's platform is "unspecified" and its parser does not build
    # (vllm/config/device.py: "Failed to infer device type"). vLLM's own CLI meets the same
    # for `vllm bench` by taking the CPU platform (vllm/entrypoints/cli/main.py); so does
    # this. It changes defaults that depend on the device, not which flags exist.
    from vllm import platforms

    cpu_platform = platforms.current_platform.is_unspecified()
    if cpu_platform:
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The CLI's parser with its serve subcommand, as vllm/entrypoints/cli/main.py builds it.
    parser = FlexibleArgumentParser(description="vLLM CLI")
    make_arg_parser(parser.add_subparsers(required=False, dest="subparser").add_parser("serve"))

    def parse(argv: list[str]) -> None:
        if argv[: len(VLLM_ENTRY)] != VLLM_ENTRY:
            raise ValueError(f"not vLLM's serve entry point: {argv[:3]}")
        args = parser.parse_args(argv[len(VLLM_ENTRY) - 1:])
        validate_parsed_serve_args(args)
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        AsyncEngineArgs.from_cli_args(args)

    import vllm.envs as envs

    facts = {
        "no_gpu_shim": "vLLM's CPU platform set, as `vllm bench` does" if cpu_platform
        else "none: vLLM found its platform",
        "entry_module_has_main": _has_main("vllm.entrypoints.cli.main"),
        "env_names": {name: name in envs.environment_variables
                      for name in ("VLLM_API_KEY", "VLLM_SERVER_DEV_MODE")},
        # --quantization takes any string on the command line; the engine checks it
        # against this list when it builds its config.
        "quantization_methods": _quantization_methods(),
    }
    # The subparser is where the flags are; describe reads it.
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags: argparse.ArgumentParser = serve.choices["serve"]
    return parse, flags, facts


def _quantization_methods() -> list[str] | str:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError as exc:
        return f"not found: {exc}"
    return sorted(QUANTIZATION_METHODS)


def _sglang() -> tuple[Callable[[list[str]], Any], argparse.ArgumentParser, dict[str, Any]]:
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)

    def parse(argv: list[str]) -> None:
        # argv[0] is our entry script's path; the rest is SGLang's own command line.
        if not argv or not argv[0].endswith("sglang_main.py"):
            raise ValueError(f"not our SGLang entry script: {argv[:1]}")
        server_args = prepare_server_args(list(argv[1:]))
        # What the entry script does next: set the key on the parsed arguments.
        server_args.api_key = "contract-check"

    facts = {
        # The names agent/engines/sglang_main.py imports from SGLang.
        "entry_imports": {f"{module}.{name}": _has(module, name) for module, name in (
            ("sglang.launch_server", "run_server"),
            ("sglang.srt.plugins", "load_plugins"),
            ("sglang.srt.server_args", "prepare_server_args"),
            ("sglang.srt.utils", "kill_process_tree"),
        )},
    }
    return parse, parser, facts


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _has_main(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    with open(spec.origin, encoding="utf-8") as source:
        return 'if __name__ == "__main__":' in source.read()


def _choices(parser: argparse.ArgumentParser, flags: Sequence[str]) -> dict[str, Any]:
    """Each flag's choices in ``parser`` (None: free), or "absent"."""
    found: dict[str, Any] = {}
    for flag in flags:
        action = parser._option_string_actions.get(flag)
        if action is None:
            found[flag] = "absent"
        else:
            found[flag] = sorted(map(str, action.choices)) if action.choices else None
    return found


def main() -> int:
    request = json.load(sys.stdin)
    engine = request["engine"]
    package = {"vllm": "vllm", "sglang": "sglang"}[engine]
    versions = {name: importlib.metadata.version(name) for name in (package, "torch")}
    try:
        parse, parser, facts = _vllm() if engine == "vllm" else _sglang()
    except Exception:  # noqa: BLE001 - the report must say why the parser did not build
        json.dump({"versions": versions, "parser_error": traceback.format_exc()}, sys.stdout)
        return 1
    results = []
    for line in request["lines"]:
        ok, error, said = _run(parse, list(line["argv"]))
        results.append({"id": line["id"], "ok": ok, "error": error, "warnings": said})
    json.dump({"versions": versions, "results": results, "facts": facts,
               "choices": _choices(parser, request.get("describe", []))}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
