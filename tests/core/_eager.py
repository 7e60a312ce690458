"""Kept for the two core files that import ``._eager``; the factory lives in
:mod:`tests._support.eager`."""

from tests._support.eager import eager_task_factory as eager_task_factory
from tests._support.eager import new_eager_loop as new_eager_loop
