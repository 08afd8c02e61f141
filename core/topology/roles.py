"""Which ranks play which role (trainers, and e.g. parameter servers)."""

from __future__ import annotations

from dataclasses import dataclass

TRAINER = "trainer"


@dataclass(frozen=True)
class Roles:
    """Which global ranks play which role. ``trainer`` ranks run the train loop over the
    ``(pp, dp, cp, tp)`` mesh; every other role runs the loop its plugin provides (``plait_run_role``).

    ``lockstep``: the trainers take their steps together, so per-step collectives among them
    (the logged figures' min/max, evaluation, checkpoints) are safe; False for trainers that step
    at their own pace (asynchronous parameter-server workers), whose per-step figures are then
    their own and whose checkpoints the first trainer writes alone.

    ``expendable``: ranks whose death the job survives (asynchronous workers other than the
    first trainer, which logs and checkpoints): plait's launcher counts such a death as the rank
    leaving, where it would otherwise end every rank.
    """

    ranks: dict[str, tuple[int, ...]]
    lockstep: bool = True
    expendable: tuple[int, ...] = ()

    @classmethod
    def resolve(cls, assigned: Roles | None, world_size: int) -> Roles:
        """The strategy's roles, checked; everyone a trainer when the strategy assigns none."""
        if assigned is None:
            return cls({TRAINER: tuple(range(world_size))})
        given = sorted(r for ranks in assigned.ranks.values() for r in ranks)
        if given != list(range(world_size)):
            raise ValueError(
                f"roles {dict(assigned.ranks)} must give each of the {world_size} "
                "ranks exactly one role"
            )
        if not assigned.ranks.get(TRAINER):
            raise ValueError(f"roles {dict(assigned.ranks)} leave no {TRAINER} rank")
        return assigned

    @property
    def trainers(self) -> list[int]:
        return list(self.ranks[TRAINER])

    @property
    def single(self) -> bool:
        """Every rank is a trainer: the layout of a plain run."""
        return len(self.ranks) == 1

    def role_of(self, rank: int) -> str:
        return next(role for role, ranks in self.ranks.items() if rank in ranks)
