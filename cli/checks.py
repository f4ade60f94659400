"""Check a command line's overrides before Hydra runs it, to answer a mistake with one line and its fix."""
from __future__ import annotations

import shutil
from typing import Optional

# launchers (hydra/launcher options) that submit through SLURM, and the commands submitit calls for them
SLURM_LAUNCHERS = ("slurm", "submitit_slurm")
SLURM_COMMANDS = ("sbatch", "srun")

FLAGS_WITH_VALUE = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c",
                     "--package", "-p", "--info", "-i"}


def hydra_overrides(args: list[str]) -> list[str]:
    """The Hydra overrides of a command line: its arguments less Hydra's flags and their values."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def group_options(config_name: str, group: str, args: list[str]) -> list[str]:
    """The options of a config group of the verb's config, the command line's hydra.searchpath included (a user's
    own folders may add some)."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    searchpath = [o for o in hydra_overrides(args) if o.lstrip("+").startswith("hydra.searchpath=")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            return sorted(loader.get_group_options(group, config_name=config_name, overrides=searchpath))
    except Exception:  # a malformed searchpath: none found here, and check_overrides says what is wrong in one line
        return []
    finally:
        GlobalHydra.instance().clear()


def check_overrides(config_name: str, args: list[str]) -> Optional[str]:
    """None if Hydra will accept the overrides, else a one-line message naming the problem and the fix."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = hydra_overrides(args)
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as err:  # the grammar's errors are not all OverrideParseException
            reason = str(err).strip().splitlines()[0]
            return (f"malformed override '{override}' ({reason}); "
                    "write key=value, group=option, +new_key=value, or a sweep key=a,b with -m")
    parsed = parser.parse_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            # with the command line's hydra.searchpath: groups may have options from the user's own folders
            searchpath = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")]
            for override in parsed:
                options = sorted(loader.get_group_options(override.key_or_group, config_name=config_name,
                                                          overrides=searchpath))
                if not options or override.is_delete():
                    continue  # a plain key: compose checks it below
                values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
                for value in values:
                    if value is not None and str(value) not in options:
                        return f"unknown {override.key_or_group} '{value}'; choose one of: {', '.join(options)}"
            if any(o.is_sweep_override() for o in parsed):
                return None  # Hydra composes each job of a sweep itself
            try:
                compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
            except (HydraException, OmegaConfBaseException) as err:
                reason = str(err).strip().splitlines()[0]
                return f"{reason} (`hprune {config_name} --help` lists the config groups and keys)"
    finally:
        GlobalHydra.instance().clear()
    return None


def check_launcher(args: list[str]) -> Optional[str]:
    """A sweep sent to SLURM from a machine without SLURM's commands: one line instead of submitit's traceback."""
    if not any(flag in args for flag in ("-m", "--multirun")):
        return None  # without -m Hydra runs the job here and ignores the launcher
    launchers = [o.partition("=")[2] for o in hydra_overrides(args) if o.partition("=")[0].lstrip("+~") == "hydra/launcher"]
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if launchers and launchers[-1] in SLURM_LAUNCHERS and missing:
        return (f"hydra/launcher={launchers[-1]} submits each job to SLURM, but this machine has no "
                f"{' or '.join(missing)} on PATH; run the sweep here with hydra/launcher=local, or start it "
                "from a SLURM login node")
    return None
