"""Everything that talks to the lock Redis; no Celery in here.

Importing the package registers each kind of engine with :mod:`.registry`,
which the rest of the library asks for one: :class:`.server.LockEngine` for
one server, a Sentinel-managed primary and a Cluster,
:class:`.redlock.engine.RedlockEngine` for a quorum of masters.
"""

from . import registry
from .redlock.engine import RedlockEngine
from .server import LockEngine

registry.register(("standalone", "sentinel", "cluster"), LockEngine.from_config)
registry.register(("redlock",), RedlockEngine.from_config)
