"""Operator tools: read a running job's state (``elasticstore status``) and stop it
(``elasticstore stop``). Reads go through the rendezvous store only; nothing here imports the
agent."""

from .control import JobAddress, JobNotFound, connect, stop_job
from .status import job_status, render

__all__ = ["JobAddress", "JobNotFound", "connect", "job_status", "render", "stop_job"]
