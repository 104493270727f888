"""The reward pools' forkserver imports this before it forks any worker (megarl.lifetime.forkserver_context): the
forkserver dies with the process that started it."""
from .lifetime import die_with_parent

die_with_parent()
