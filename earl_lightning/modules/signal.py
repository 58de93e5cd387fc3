"""Whether an RL run can learn anything: a step whose groups all got equal rewards
(``reward/zero_std_groups`` 1.0: a group-relative advantage is 0 for every token) or whose
gradient norm is 0 teaches the model nothing. A run can go on like that for every step while its
curves look like any other run's; :class:`LearningSignal` counts such steps in a row and says
once, in words, what it means and what to try."""

from __future__ import annotations

from dataclasses import dataclass

METRIC = "train/steps_without_signal"


@dataclass
class LearningSignal:
    """Counts the steps in a row without a learning signal; after ``patience`` of them
    :meth:`update` returns one warning (once per run). ``patience`` 0: never warns."""

    patience: int
    streak: int = 0
    warned: bool = False

    def update(self, zero_std_groups: float, grad_norm: float) -> str | None:
        """This step's share of groups with equal rewards and its gradient norm; the warning,
        the first time the streak reaches ``patience``."""
        flat, still = zero_std_groups >= 1.0, grad_norm == 0.0
        self.streak = self.streak + 1 if flat or still else 0
        if not self.patience or self.warned or self.streak < self.patience:
            return None
        self.warned = True
        why = (
            "every group's episodes got the same reward (reward/zero_std_groups 1.0), so a "
            "group-relative advantage (GRPO, RLOO) is 0 for every token"
            if flat
            else "the gradient norm was 0"
        )
        return (
            f"no learning signal for {self.streak} steps in a row: {why}; the model is not "
            f"learning from these rewards. Try a warm start (`earl sft`, or more demonstrations "
            f"in it) so that some episodes succeed, a larger `--data.group_size` so that a "
            f"group's rewards differ, or a reward that tells better episodes from worse ones "
            f"({METRIC} counts such steps; `--model.no_signal_steps` sets when this warns)"
        )
