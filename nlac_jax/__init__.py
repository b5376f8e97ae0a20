"""nlac_jax: Natural Language Actor-Critic in JAX/Flax (docs/ARCHITECTURE.md maps the packages)."""

import importlib.abc
import sys

# The storage settings (fs.configure: STORAGE_EMULATOR_HOST mapped to every GCS client, gcsfs as etils.epath's
# backend) are environment variables that gcsfs and tensorstore read when first used: set them before anything else.
from nlac_jax.storage import fs  # noqa: F401

# Modules that left the package root for a package of their concern. An old name (a user's gin file saying
# `import nlac_jax.loop`) fails with one line naming the new one instead of a bare "No module named".
MOVED_MODULES = {
    "cli": "cli.common", "configurables": "cli.configurables",
    "sharding": "parallel.sharding", "distributed": "parallel.distributed", "xla_options": "parallel.xla_options",
    "compilations": "parallel.compilations", "footprint": "planning.footprint", "tpu_specs": "planning.tpu_specs",
    "loop": "runner.loop", "interrupts": "runner.interrupts", "run_lock": "runner.run_lock", "fs": "storage.fs",
    "metrics": "observability.metrics", "tiny": "testing.tiny", "roles": "rl.roles",
    "models.building": "runner.building",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """Consulted only after the normal finders found nothing: names a moved module's new home."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.partition("nlac_jax.")[2]
        if fullname.startswith("nlac_jax.") and old in MOVED_MODULES:
            raise ModuleNotFoundError(f"{fullname} moved to nlac_jax.{MOVED_MODULES[old]}: update the import "
                                      f"(gin files too)", name=fullname)
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
