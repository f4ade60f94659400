"""hprune <verb> [hydra overrides] [-m]

Pops the verb, checks the overrides (one clear line on a mistake), then hands the rest of the command line to
that verb's Hydra app, so `-m`, `--cfg job`, `--help` and launchers work as in any Hydra program.
Nothing heavy is imported before a verb is chosen.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys

# verb -> (runner module, one-line help); each verb's primary config is configs/<verb>.yaml
VERBS = {
    "train": ("hprune.runner.train", "train a Transformer with fairseq (default: tiny model on the synthetic task)"),
    "eval": ("hprune.runner.evaluate", "translate a split with a checkpoint; sacreBLEU BLEU/chrF to metrics.json"),
    "data": ("hprune.runner.data", "`hprune data prepare data={data}`: download, prepare, binarize (cached);"
                                   " `hprune data fetch published=NAME`: a published fairseq model"),
    "prune": ("hprune.runner.prune", "`hprune prune --method {prune} ckpt=PATH`: which heads go, and what it costs"),
    "export": ("hprune.runner.export", "`hprune export ckpt=PATH [mask=head_mask.json] format={export}`: "
                                       "the pruned model for a runtime"),
    "recover": ("hprune.runner.recover", "`hprune recover ckpt=MODEL mask=RUN recovery.loss=ce|word|sequence`: the pruned "
                                         "model trained on, the unpruned one its teacher"),
    "analyze": ("hprune.runner.analyze", "head roles (positional, syntactic, rare-token, confidence) of a checkpoint"),
    "report": ("hprune.runner.report", "`hprune report DIR ...`: methods compared (matched sparsity, MACs, seeds), "
                                       "controls, MoA, plots"),
}
# words before or between the overrides: `hprune data prepare` -> action=prepare (one of the choices);
# `hprune report A B` -> runs=['A','B'] (choices None: any number of free values)
POSITIONAL = {"data": ("action", ("prepare", "fetch")), "report": ("runs", None)}
SUGAR = {"prune": {"--method": "prune"}}  # `hprune prune --method voita` -> prune=voita
# a key whose value is also an option of a config group: `hprune export format=fairseq` -> export=fairseq (the
# format and its own settings, configs/export/fairseq.yaml); a value the group lacks stays the key's (a format of
# one's own without settings: format=state_dict format_module=...)
GROUP_KEYS = {"export": {"format": "export"}}

USAGE = "usage: hprune <verb> [key=value ...] [-m] [--cfg job] [--help]"


def _choices(group: str) -> str:
    """The configs of a group (configs/<group>/*.yaml), read from the folder without importing anything."""
    from importlib.util import find_spec
    from pathlib import Path

    folder = Path(next(iter(find_spec("hprune_configs").submodule_search_locations))) / group
    return "|".join(sorted(path.stem for path in folder.glob("*.yaml")))


def _help() -> str:
    lines = [USAGE, "", "verbs:"]
    # the registries' names as the config groups list them (the registries themselves import torch and fairseq;
    # tests/test_configs.py keeps the two the same)
    choices = {group: _choices(group) for group in ("data", "prune", "export")}
    lines += [f"  {verb:<8} {desc.format(**choices)}" for verb, (_, desc) in VERBS.items()]
    lines += ["  (a method, data kind or export format of your own: docs/development.md, 'Extensions')"]
    lines += ["", "`hprune <verb> --help` lists that verb's config groups and options.",
              "Examples:  hprune train model=transformer_tiny optim.max_update=500",
              "           hprune eval ckpt=outputs/train/<run>",
              "           hprune prune --method michel ckpt=outputs/train/<run>",
              "           hprune train -m seed=1,2,3",
              "           hprune report outputs/"]
    return "\n".join(lines)


def fail(verb: str, message: str) -> None:
    print(f"hprune {verb}: error: {message}" if verb else f"hprune: error: {message}", file=sys.stderr)
    sys.exit(2)


def _complete(args: list[str]) -> None:
    """Hydra's shell completion (`eval "$(hprune -sc install=bash)"`). The installed script calls
    `hprune -sc query=bash` with the whole line in COMP_LINE: complete the verb, or hand the line without
    the verb to that verb's app."""
    words = os.environ.get("COMP_LINE", "").split(" ")
    verb = words[1] if len(words) > 2 and words[1] in VERBS else None
    if verb is None and not any(a.startswith(("install=", "uninstall=")) for a in args):
        prefix = words[1] if len(words) > 1 else ""
        print(" ".join(v for v in VERBS if v.startswith(prefix)))
        return
    if verb is not None:
        os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]])
    sys.argv = ["hprune", *args]
    importlib.import_module(VERBS[verb or "train"][0]).main()


def _desugar(verb: str, args: list[str]) -> list[str]:
    """`--method X` / `--method=X` -> `prune=X` (a config-group choice, so sweeps and --help still work).
    Overrides go after the flags: Hydra's parser takes no flag (`-m`, `--cfg job`) after the first override."""
    flags, out, overrides, i = SUGAR.get(verb, {}), [], [], 0
    while i < len(args):
        flag, _, value = args[i].partition("=")
        if flag in flags:
            if not value:
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    fail(verb, f"{flag} needs a value, e.g. {flag} michel")
                value, i = args[i + 1], i + 1
            overrides.append(f"{flags[flag]}={value}")
        elif "=" in args[i] and not args[i].startswith("-"):
            overrides.append(args[i])
        else:
            out.append(args[i])
        i += 1
    return out + overrides


def positional(verb: str, args: list[str]) -> list[str]:
    """The verb's free words (neither flags nor key=value) turned into its POSITIONAL key's override."""
    if verb not in POSITIONAL:
        return args
    from hprune_cli.checks import FLAGS_WITH_VALUE

    key, choices = POSITIONAL[verb]
    words, others, i = [], [], 0
    while i < len(args):
        if args[i] in FLAGS_WITH_VALUE and i + 1 < len(args):
            others += args[i:i + 2]
            i += 2
            continue
        (others if args[i].startswith("-") or "=" in args[i] else words).append(args[i])
        i += 1
    if not words:
        return others
    if choices is not None:
        wrong = [w for w in words if w not in choices]
        if wrong:
            fail(verb, f"unknown {key} '{wrong[0]}'; choose one of: {', '.join(choices)}")
        if len(words) > 1:
            fail(verb, f"one {key} at a time, not {' '.join(words)}")
        return [f"{key}={words[0]}", *others]
    quoted = ",".join("'" + w.replace("\\", "\\\\").replace("'", "\\'") + "'" for w in words)
    return [f"{key}=[{quoted}]", *others]


MODEL_VERBS = ("eval", "prune", "analyze", "export")  # verbs that measure a model on data


def _model_data(verb: str, args: list[str]) -> list[str]:
    """A checkpoint that brings its own data settings (hprune.yaml: a published or imported model; a Hugging Face
    folder; a Hub id; a published name): data=pretrained unless the command line chose data."""
    if verb not in MODEL_VERBS or any(a.lstrip("+~").startswith("data=") for a in args):
        return args
    ckpt = next((a.partition("=")[2] for a in reversed(args) if a.startswith("ckpt=")), None)
    if not ckpt or "," in ckpt:  # a sweep over checkpoints: each may be another kind
        return args
    from hprune.checkpoint_ref import identify  # (what the verb resolves, told from the files here)

    return args + ["data=pretrained"] if identify(ckpt).brings_its_data else args


def _group_keys(verb: str, args: list[str]) -> list[str]:
    """`key=value` -> `group=value` where the verb's GROUP_KEYS pair them and the group has every value (a sweep's
    too), unless the command line chose the group itself."""
    chosen = {a.lstrip("+~").partition("=")[0] for a in args}
    pairs = {key: group for key, group in GROUP_KEYS.get(verb, {}).items() if key in chosen and group not in chosen}
    if not pairs:
        return args
    from hprune_cli.checks import group_options

    options = {group: group_options(verb, group, args) for group in pairs.values()}
    out = []
    for arg in args:
        key, _, value = arg.partition("=")
        selects = key in pairs and all(v in options[pairs[key]] for v in value.split(","))
        out.append(f"{pairs[key]}={value}" if selects else arg)
    return out


def overrides(verb: str, args: list[str]) -> list[str]:
    """The command line as the verb's Hydra app takes it: positional words and sugar mapped, a key that selects a
    group's option turned into that choice, a model folder's data implied."""
    return _model_data(verb, _group_keys(verb, _desugar(verb, positional(verb, args))))


def main(argv: list[str] | None = None) -> None:
    """The console script. Ctrl-C or SIGTERM anywhere in a verb is one line, once the cleanups on the way out
    have run (errors.py); then the process ends by that signal itself, as Python ends on an uncaught Ctrl-C, so
    the shell reports 128 + N and a shell script running hprune stops too (bash carries on after a child that
    merely exits 130). Called with `argv` (in process, as the tests do), it exits with 128 + N instead."""
    from hprune.errors import as_interrupted, signals_raise

    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = argv[0] if argv and argv[0] in VERBS else ""
    with signals_raise():
        try:
            _main(argv)
        except BaseException as err:
            stop = as_interrupted(err)
            if stop is None:
                raise
            print(f"hprune{' ' + verb if verb else ''}: {stop.describe()}; nothing half-written was kept "
                  "(finished steps are, and the same command continues from them)", file=sys.stderr)
            if own_process:
                import signal

                sys.stdout.flush()
                sys.stderr.flush()
                signal.signal(stop.signum, signal.SIG_DFL)
                os.kill(os.getpid(), stop.signum)
            sys.exit(stop.exit_status)


def _main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_help())
        return
    if argv[0] in ("-sc", "--shell-completion"):
        _complete(argv)
        return
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        fail("", f"unknown verb '{verb}'; choose one of: {', '.join(VERBS)} (see `hprune --help`)")
    rest = overrides(verb, rest)
    if any(f in rest for f in ("-m", "--multirun")) and any(f in rest for f in ("--cfg", "-c")):
        fail(verb, "--cfg prints the config of one run and -m starts a sweep; drop -m and give one value per "
                   "key to see a job's config")
    if not any(flag in rest for flag in ("--help", "-h", "--hydra-help")):
        from hprune_cli.checks import check_launcher, check_overrides

        from hprune.launch import check_run_dir

        problem = check_overrides(verb, rest) or check_launcher(rest) or check_run_dir(rest)
        if problem:
            fail(verb, problem)
    if _shown_hydra_config(verb, rest):
        return
    sys.argv = [f"hprune {verb}", *rest]
    launchers = "hydra_plugins.hprune_launchers"  # hprune's SLURM launcher, if the run loaded it
    if launchers in sys.modules:  # (several verbs in one process: the tests)
        sys.modules[launchers].FAILED.clear()
    with _flops_counted():
        importlib.import_module(VERBS[verb][0]).main()
    failed = getattr(sys.modules.get(launchers), "FAILED", None)  # a sweep's failed jobs, each said in a line
    if failed:
        print(f"hprune {verb}: {len(failed)} job(s) of the sweep failed; the others completed", file=sys.stderr)
        sys.exit(3)


def _flops_counted():
    """The verb's FLOPs counted into the file HPRUNE_FLOPS_TO names (the benchmarks'), else nothing."""
    if not os.environ.get("HPRUNE_FLOPS_TO"):
        return contextlib.nullcontext()
    from hprune.flops import flops_written_to
    return flops_written_to(os.environ["HPRUNE_FLOPS_TO"])


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of a flag given as `--flag value` or `--flag=value` (the last one given), else None."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def _shown_hydra_config(verb: str, args: list[str]) -> bool:
    """`--cfg hydra --resolve`. Hydra resolves its own node cut off from the rest of the config, so the keys it
    names (paths.output_root, verb) are not found (an InterpolationKeyError traceback): resolved here within the
    whole config, then printed as Hydra prints it. False for anything else (Hydra answers)."""
    if _flag_value(args, "--cfg", "-c") != "hydra" or "--resolve" not in args:
        return False
    from hprune_cli.checks import hydra_overrides
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, flag_override

    package = _flag_value(args, "--package", "-p")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
            cfg = compose(config_name=verb, overrides=hydra_overrides(args), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_readonly(cfg.hydra, None)
    OmegaConf.resolve(cfg)
    with flag_override(cfg, ["struct", "readonly"], [False, False]):
        for key in [k for k in cfg if k != "hydra"]:
            del cfg[key]
    with flag_override(cfg.hydra, ["struct", "readonly"], [False, False]):
        for key in ("help", "hydra_help"):  # as Hydra's --cfg hydra leaves them out
            del cfg.hydra[key]
    if package not in (None, "_global_"):
        selected = OmegaConf.select(cfg, package)
        if selected is None:
            fail(verb, f"package '{package}' is not in the config; --package hydra.launcher, for example")
        print(f"# @package {package}")
        print(OmegaConf.to_yaml(selected), end="") if OmegaConf.is_config(selected) else print(selected)
        return True
    print(OmegaConf.to_yaml(cfg), end="")
    return True


if __name__ == "__main__":
    main()
