from earl_lightning.callbacks.adaptive import AdaptiveParallelism
from earl_lightning.callbacks.progress import StepProgressBar
from earl_lightning.warnings_filter import install_warning_filters

# Python users build their Trainer with these callbacks: installing the library-internal warning
# filters here reaches them as well as the `earl` CLI.
install_warning_filters()

__all__ = ["AdaptiveParallelism", "StepProgressBar"]
