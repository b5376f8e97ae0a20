# The storage settings (fs.configure: STORAGE_EMULATOR_HOST mapped to every GCS client, gcsfs as etils.epath's
# backend) are environment variables that gcsfs and tensorstore read when first used: set them before anything else.
from nlac_jax import fs  # noqa: F401
