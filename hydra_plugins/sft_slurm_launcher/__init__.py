"""sft's SLURM launcher as a Hydra plugin (Hydra takes launchers from the `hydra_plugins` namespace only): the class
is `sft.experiments.slurm_launcher.SlurmLauncher`; `hydra/launcher=slurm` and `slurm_cpu` name this one. Without
hydra-submitit-launcher (the `sweeps` extra) there is none, and Hydra's plugin scan finds nothing here to import."""

try:
    from sft.experiments.slurm_launcher import SlurmLauncher as _SlurmLauncher
except ImportError:  # hydra-submitit-launcher is not installed
    _SlurmLauncher = None

if _SlurmLauncher is not None:

    class SlurmLauncher(_SlurmLauncher):
        """`sft.experiments.slurm_launcher.SlurmLauncher`, where Hydra finds launchers."""
