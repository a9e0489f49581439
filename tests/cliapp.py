"""The test worker app with the config masking installed when the worker starts,
where the worker step should install it (`celery -A tests.cliapp:app worker`)."""

from __future__ import annotations

from typing import Any

from celery.signals import worker_init

from celery_singleton_lock.observe import masking
from tests.workerapp import _from_env

app = _from_env()


@worker_init.connect(weak=False)
def install_masking(**_: Any) -> None:
    masking.install()
