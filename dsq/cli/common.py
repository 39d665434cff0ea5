"""The Typer app and the error boundary every command runs inside (options: dsq.cli.options)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
from typing import Annotated, Callable

import typer
from typer.core import TyperCommand, TyperGroup

from dsq import __version__
from dsq.errors import DsqError, Terminated

# click's exception classes as this typer uses them (newer typers vendor click)
_BadParameter = typer.BadParameter
_UsageError = next(c for c in _BadParameter.__mro__ if c.__name__ == "UsageError")


def _usage_error(e, where: str | None = None) -> None:
    """A bad flag or value: one line on stderr, pointing at the help of the command (`where`) it
    was given to. A bad value exits 1 like every user error; a flag or command that does not exist
    exits 2 (click's usage error)."""
    if type(e).__name__ == "NoArgsIsHelpError":  # plain `dsq`: its help
        raise e
    if isinstance(e, _BadParameter):
        message = e.message.removeprefix("Value error, ").rstrip(".")
        message = message[:1].lower() + message[1:] if message[1:2].islower() else message
        fail(f"invalid value for {_param_name(e)}: {message}")
    where = where or (e.ctx.command_path if e.ctx is not None else "dsq")
    message = e.format_message().rstrip()
    if not message.endswith(("?", "!", ".")):
        message += "."
    fail(f"{message} See '{where} --help'", 2)


def _param_name(e) -> str:
    p = e.param
    if p is None:
        return e.param_hint or "a parameter"
    longs = [o for o in p.opts if o.startswith("--")]
    return longs[0] if longs else p.human_readable_name.upper()


def _without_flag_types(cmd, ctx) -> None:
    """On/off flags take no value, so their help shows no type (typer would show <bool>)."""
    for p in cmd.get_params(ctx):
        if getattr(p, "is_flag", False):
            p.metavar = ""


# each command's old flag spellings: {old: new}; "OLD FILE": only where a file path follows it
_RENAMED: dict[str, dict[str, str]] = {}


def renamed_args(args: list[str], renamed: dict[str, str]) -> list[str]:
    """ARGS with old flag spellings swapped for the new ones, a note on stderr for each."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        new = renamed.get(name)
        file_only = renamed.get(f"{name} FILE")
        if new is None and file_only is not None and (eq or (i + 1 < len(out) and out[i + 1].endswith(".json"))):
            new = file_only
        if new is not None:
            typer.echo(f"note: {name} is now {new}", err=True)
            out[i] = new + eq + value
    return out


class _Command(TyperCommand):
    """A subcommand: old flag spellings accepted with a note, usage errors naming its own help."""

    def make_context(self, info_name, args, parent=None, **extra):
        args = renamed_args(args, _RENAMED.get(self.name, {}))
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _UsageError as e:
            _usage_error(e, f"{parent.command_path} {info_name}" if parent is not None else info_name)

    def format_help(self, ctx, formatter) -> None:
        _without_flag_types(self, ctx)
        return super().format_help(ctx, formatter)


class _Group(TyperGroup):
    """The dsq group: usage errors as one line (see _usage_error), help without flag types."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except _UsageError as e:
            _usage_error(e)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except _UsageError as e:
            _usage_error(e)

    def format_help(self, ctx, formatter) -> None:
        _without_flag_types(self, ctx)
        return super().format_help(ctx, formatter)


app = typer.Typer(
    name="dsq",
    cls=_Group,
    help="Quantize DeepSeek-family LLMs and run them locally, fast, on any mix of GPU and CPU.\n\n"
         "With no MODEL argument, commands use the built-in Gemma 3 270M (Q4_K_M) model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def reflow(doc: str | None) -> str | None:
    """A docstring as help text: its paragraphs unwrapped, so that the terminal wraps them."""
    if not doc:
        return doc
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in para.splitlines()) for para in paragraphs)


def _os_error(e: OSError) -> str:
    """What an OSError from reading or writing a path says, in one line."""
    return f"cannot use {e.filename}: {e.strerror or e}"


def _internal(e: BaseException) -> str:
    return f"internal error: {type(e).__name__}: {e} (run with DSQ_DEBUG=1 for the traceback and please report it)"


@contextlib.contextmanager
def sigterm_stops():
    """SIGTERM inside: raised as Terminated where the command is, so that it stops as Ctrl-C stops
    it (its work kept, one line said) instead of dying silently."""
    def stop(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: the default stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def command(name: str, examples: list[str], renamed: dict[str, str] | None = None, **kwargs) -> Callable:
    """Register a subcommand whose user errors print one line and exit 1; `renamed`: its old
    flag spellings, still accepted with a note (see renamed_args).

    DSQ_DEBUG=1 lets every exception through with its traceback.
    """
    _RENAMED[name] = renamed or {}
    epilog = "[bold]Examples[/bold]\n\n" + "\n\n".join(f"  [cyan]{e}[/cyan]" for e in examples)

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            if os.environ.get("DSQ_DEBUG"):
                return fn(*args, **kw)
            try:
                return fn(*args, **kw)
            except DsqError as e:
                fail(e.one_line(), e.exit_code)
            except KeyboardInterrupt as e:  # its message, if any, says what a rerun resumes from
                word, code = ("terminated", 143) if isinstance(e, Terminated) else ("interrupted", 130)
                typer.echo(word + (f"; {e}" if str(e) else ""), err=True)
                raise typer.Exit(code) from None
            except (typer.Exit, typer.Abort):
                raise
            except MemoryError:
                fail("out of memory; try a smaller model, a smaller --ctx, or fewer --gpu-layers")
            except BrokenPipeError:  # stdout closed early (| head): nothing more to say
                raise typer.Exit(1) from None
            except OSError as e:  # a path the system refused (a file where a folder must be, permissions)
                fail(_os_error(e) if e.filename else _internal(e))
            except Exception as e:  # a bug: one line, with the way to see more
                fail(_internal(e))

        return app.command(name, epilog=epilog, help=reflow(fn.__doc__), cls=_Command, **kwargs)(wrapper)

    return deco
