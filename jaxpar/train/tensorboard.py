"""Optional TensorBoard scalars (``train.tensorboard_dir``) through ``tensorboardX``."""

from __future__ import annotations

import jax

from jaxpar.errors import ConfigError


class TensorBoard:
    """Scalar TensorBoard event files through ``tensorboardX`` (an optional dependency).

    A resumed run appends a new event file to the same directory; TensorBoard merges them by
    step. Only process 0 writes.
    """

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"train.tensorboard_dir={logdir!r}: needs the optional package tensorboardX "
                "(pip install 'jaxpar[tensorboard]')"
            ) from None
        self._w = SummaryWriter(logdir) if jax.process_index() == 0 else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write ``values`` as ``train/<name>`` scalars at ``step``."""
        if self._w is not None:
            for k, v in values.items():
                self._w.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._w is not None:
            self._w.close()
            self._w = None
