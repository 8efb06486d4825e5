"""Operator tools: read a running job's state (``elasticstore status``), stop it
(``elasticstore stop``) and remove a finished job's keys (``elasticstore forget``). Everything
goes through the rendezvous store only; nothing here imports the agent."""

from .control import JobAddress, JobNotFound, connect, stop_job
from .forget import RunAlive, forget_run
from .status import job_status, render

__all__ = ["JobAddress", "JobNotFound", "RunAlive", "connect", "forget_run", "job_status", "render",
           "stop_job"]
