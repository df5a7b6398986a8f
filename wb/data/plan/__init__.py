"""Plans: who sends which bytes to whom (:class:`Plan`), and one rank's part of one
(:class:`RankPlan`), as plain values.

By concern: :mod:`~wb.data.plan.arrays` (the arrays a plan is made of, :class:`Traffic`),
:mod:`~wb.data.plan.plan` (:class:`Plan`), :mod:`~wb.data.plan.verify` (its element-exact check),
:mod:`~wb.data.plan.files` (save and load, its fingerprint), :mod:`~wb.data.plan.schedule` (when
each message should move, how many forwards from its trainer), :mod:`~wb.data.plan.reference` (:func:`run_local`, the reference
executor) and :mod:`~wb.data.plan.part` (:class:`RankPlan`: what one rank runs).
"""

from wb.data.plan.arrays import Messages, Pieces, SlotTable, Traffic, Transfers, slot_table
from wb.data.plan.part import RankPlan, part_of, parts
from wb.data.plan.plan import Plan
from wb.data.plan.reference import run_local
from wb.data.plan.schedule import hops, schedule

__all__ = ["Plan", "RankPlan", "Traffic", "Pieces", "Transfers", "Messages", "SlotTable",
           "slot_table", "schedule", "hops", "run_local", "parts", "part_of"]
