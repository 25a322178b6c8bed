"""Schedules as data, shared by lowering, runtime and planning: the action IR, its generators,
its static verifier and the Seq1F1B chunk boundaries (``chunks``)."""

from autopart.schedule.generators import GENERATORS, check_schedule, generate
from autopart.schedule.ir import Action, table
from autopart.schedule.verify import verify

__all__ = ["GENERATORS", "Action", "check_schedule", "generate", "table", "verify"]
