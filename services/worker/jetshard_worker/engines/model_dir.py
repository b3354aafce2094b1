"""What an engine reads from a model's directory besides its weights, whichever engine serves it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.sampling import generation_config_defaults

log = logging.getLogger(__name__)


def read_generation_config(model_dir: Path) -> GenerationDefaults:
    """The sampling defaults in the model's generation_config.json; a missing or unreadable file sets none
    (it is optional, and a broken one must not keep the model from serving)."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return GenerationDefaults()
    except (OSError, ValueError) as error:
        log.warning("ignoring %s/generation_config.json: %s", model_dir, error)
        return GenerationDefaults()
    return generation_config_defaults(config)
