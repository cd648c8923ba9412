"""The `ttt-bench` command. Entry points stay thin: each subcommand parses its arguments and calls
the library. `train` and `eval` are Hydra apps (overrides, --multirun, --cfg job, --help)."""

import contextlib
import math
import os
import re
import shutil
import sys
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException
from ttt_bench.cli.common import SUBCOMMANDS, ArgumentParser, did_you_mean, fail, os_error

from ttt_bench.allocator import retain_freed_memory
from ttt_bench.errors import Interrupted, UserError

__all__ = ["SUBCOMMANDS", "ArgumentParser", "fail", "main", "os_error"]

def user_error(e: BaseException) -> UserError | None:
    """The UserError behind `e`, e.g. one raised by a resolver, wrapped by OmegaConf (which chains it as the
    cause, or as the context where it resolves Hydra's run folder)."""
    while e is not None and not isinstance(e, UserError):
        e = e.__cause__ or e.__context__
    return e


def one_line(e: BaseException) -> str:
    """The most specific line of an exception (Hydra wraps instantiation errors in several lines)."""
    if found := user_error(e):
        return str(found)
    if e.__cause__ is not None and not isinstance(e.__cause__, OmegaConfBaseException):
        e = e.__cause__  # e.g. the model's ValueError inside Hydra's InstantiationException
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("full_key", "object_type"))]
    return lines[-1] if lines else type(e).__name__


def quoting_hint(args: list[str]) -> str:
    """For a value that Hydra's override grammar cannot read unquoted (a comma, a quote, brackets, a
    backslash, a non-ASCII letter): the override and how to quote it; "" when no value needs it."""
    for arg in args:
        key, eq, value = arg.partition("=")
        special = re.search(r"[,'\"\\\[\]{}()]|[^\x00-\x7f]", value)
        if not eq or value[:1] in ("'", '"', "[", "{") or not special:
            continue
        quoted = f'{key}="{value}"' if "'" in value else f"{key}='{value}'"
        shell = f"'{quoted}'" if "'" not in quoted else f'"{quoted.replace(chr(34), chr(92) + chr(34))}"'
        return (f"bad override {arg}: Hydra's override grammar cannot read this value unquoted (commas, "
                f"quotes, brackets and non-ASCII letters need quotes); write it as {shell} (the outer quotes "
                "are the shell's)")
    return ""


def composition_error(e: Exception, args: list[str] = ()) -> str:
    """One line for an error composing the config from the command line, with a "did you mean" or how to
    quote a value."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if found := user_error(e):  # e.g. run_name=../x, refused by its resolver
        return str(found)
    cause = e.__cause__
    if isinstance(e, MissingConfigException) and e.options:  # model=transfomer
        group, _, name = e.missing_cfg_file.rpartition("/")
        return f"unknown {group} '{name}'" + did_you_mean(name, e.options)
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.parent_node is not None:  # a typo
        parent = cause.full_key.rpartition(".")[0]
        hint = did_you_mean(str(cause.key), cause.parent_node.keys(), f"{parent}." if parent else "")
        return f"unknown config key '{cause.full_key}'{hint} (add a new key with +key=value)"
    grammar = isinstance(e, OverrideParseException) or "add --multirun" in str(e)  # a comma: "a sweep?"
    if grammar and (hint := quoting_hint(args)):
        return hint
    if isinstance(e, OverrideParseException):
        return f"bad override: {str(e).splitlines()[0]}; write it as key=value"
    return f"bad override: {one_line(e)}"


def run_hydra_app(command: str, config_name: str, task, args: list[str]) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException, InstantiationException

    from ttt_bench.config import CONFIG_MODULE  # (importing it registers the resolvers)

    argv_before = sys.argv
    program = sys.argv[0]  # how this process was started: .../bin/ttt-bench, or cli/main.py under python -m

    def app(cfg):
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        # what the folder held before this command (beside Hydra's own files, written anew by every command):
        # a failed command removes only a folder it made, never an earlier run's results
        earlier = [p for p in run_dir.iterdir() if p.name != ".hydra" and p.suffix != ".log"]
        try:
            # While the task runs, sys.argv is the command line again: Lightning's DDP/FSDP launcher starts
            # the other ranks of a node as `python <sys.argv[0]> <sys.argv[1:]>` (`python -m <module> ...`
            # under `python -m ttt_bench.cli.main`), plus the Hydra run folder: they need the subcommand.
            sys.argv = [program, command, *args]
            return task(cfg, run_dir)
        except Interrupted as e:  # Ctrl-C / SIGTERM, the step saved. Hydra reports an Exception that leaves
            # the task ("Error executing job with overrides: [...]") before main() prints its one line, and a
            # --multirun would go on to its next job; a KeyboardInterrupt passes through Hydra untouched.
            raise KeyboardInterrupt(str(e)) from e
        except (UserError, InstantiationException, OmegaConfBaseException, ValueError, OSError) as e:
            from lightning.pytorch.utilities.rank_zero import rank_zero_only

            from ttt_bench.training.run_folder import RunFolderInUse

            busy = isinstance(e, RunFolderInUse)  # the folder is another process's
            busy = busy or rank_zero_only.rank != 0  # a multi-process run's folder: rank 0 tidies up
            made_here = not earlier and not any(run_dir.glob("checkpoints/*.ckpt"))
            if not busy and made_here:  # no half-written run folder left
                shutil.rmtree(run_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    run_dir.parent.rmdir()  # runs/<run_name>/ when this was its only run
            fail(os_error(e) if isinstance(e, OSError) else one_line(e))

    sys.argv = [f"ttt-bench {command}", *args]  # Hydra's overrides (argv[1:]) and its name in messages
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composition errors reach us instead of Hydra's multi-line report
    try:
        hydra.main(config_path=CONFIG_MODULE, config_name=config_name, version_base="1.3")(app)()
    except (HydraException, OmegaConfBaseException) as e:
        fail(composition_error(e, args))
    finally:
        sys.argv = argv_before
        if full_error is None:
            del os.environ["HYDRA_FULL_ERROR"]


def cmd_train(args: list[str]) -> None:
    from ttt_bench.training.train import train

    run_hydra_app("train", "train", train, args)


# train's config groups that eval reads from the checkpoint: an override of one would be ignored
FROM_CHECKPOINT = ("model", "size", "recipe", "trainer", "task", "logger", "experiment")


def cmd_eval(args: list[str]) -> None:
    from ttt_bench.training.eval_run import run_eval

    for arg in args:
        group = arg.lstrip("+~").partition("=")[0].split(".")[0].split("/")[0]
        if group in FROM_CHECKPOINT:
            fail(f"{arg}: ttt-bench eval takes the model, its size and how it was trained from the "
                 "checkpoint; leave it out, or pass the checkpoint of another run (eval's options: data=, "
                 "seq_len=, max_tokens=, batch_size=, device=, force=)")
    run_hydra_app("eval", "eval", run_eval, args)


def cmd_generate(args: list[str]) -> None:
    p = ArgumentParser(prog="ttt-bench generate",
                       description="Sample text from a trained checkpoint, prefilling the prompt and "
                       "decoding with the model's own cache.")
    p.add_argument("ckpt", help="checkpoint (.ckpt) written by ttt-bench train")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(args)
    if not a.prompt:
        fail("--prompt is empty; give some text to continue, e.g. --prompt 'The'")
    if a.max_new_tokens < 1 or a.top_k < 0:
        fail("--max-new-tokens must be >= 1 and --top-k >= 0")
    if not -(2**63) <= a.seed < 2**64:  # torch.Generator.manual_seed's range
        fail(f"--seed {a.seed} is outside torch's seed range [-2**63, 2**64); use e.g. --seed 0")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        fail(f"--temperature {a.temperature} must be a number >= 0 (0: greedy decoding)")
    from ttt_bench.generate import sample
    from ttt_bench.training.checkpoint import load_checkpoint, torch_device

    module, tok = load_checkpoint(a.ckpt, map_location=torch_device(a.device, "--device"))
    prompt = os.fsencode(a.prompt).decode("utf-8", errors="replace")  # bytes that are not UTF-8: U+FFFD
    ids = tok.encode(prompt).tolist()
    out = sample(module.model, ids, a.max_new_tokens, a.temperature, a.top_k or None, tok.eos_id, a.seed)
    print(prompt + tok.decode(out))


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate}
# ablate, plot, bench and doctor live in their own modules: cli/<name>.py with run(args: list[str]).


def dispatch(command: str, args: list[str]) -> None:
    if command in COMMANDS:
        return COMMANDS[command](args)
    import importlib

    importlib.import_module(f"ttt_bench.cli.{command}").run(args)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ttt-bench {" + ",".join(SUBCOMMANDS) + "} ...\n\nsubcommands (each has --help):")
        for name, text in SUBCOMMANDS.items():
            print(f"  {name:9s} {text}")
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        fail(f"unknown subcommand '{command}'" + did_you_mean(command, SUBCOMMANDS))
    retain_freed_memory()
    from hydra.errors import HydraException

    try:
        dispatch(command, rest)
    except UserError as e:
        fail(str(e))
    except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C / SIGTERM: training saved its last finished step
        fail(str(e) or Interrupted(), code=130)  # a sweep's Interrupted arrives as a KeyboardInterrupt
    except (HydraException, OmegaConfBaseException) as e:  # e.g. bench's --set, --size
        fail(composition_error(e, rest))
    except BrokenPipeError:  # the reader went away (`ttt-bench ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(141)
    except OSError as e:  # a full disk, a missing or unreadable file
        fail(os_error(e))


if __name__ == "__main__":
    main()
