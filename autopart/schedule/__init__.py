"""Schedules as data: the action IR, its generators and its static verifier."""

from autopart.schedule.generators import GENERATORS, generate
from autopart.schedule.ir import Action, table
from autopart.schedule.verify import verify

__all__ = ["GENERATORS", "Action", "generate", "table", "verify"]
