"""A model's weights_bytes (what a sleeping replica keeps of its claim): bounded by its
memory_bytes, which it needs declared, and by MAX_MEMORY_BYTES; absent by default."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from modelkeeper.domain.catalog import MAX_MEMORY_BYTES, ModelSpec

GIB = 1 << 30


def _spec(**fields: Any) -> ModelSpec:
    return ModelSpec(**{"model_id": "m", "engine": "vllm", "source": "org/m", **fields})


def test_weights_bytes_is_optional_and_kept() -> None:
    assert _spec(memory_bytes=8 * GIB).weights_bytes is None
    assert _spec(memory_bytes=8 * GIB, weights_bytes=8 * GIB).weights_bytes == 8 * GIB


@pytest.mark.parametrize(("fields", "words"), [
    ({"memory_bytes": 8 * GIB, "weights_bytes": 9 * GIB}, "above memory_bytes"),
    ({"weights_bytes": GIB}, "needs memory_bytes"),
    ({"memory_bytes": 8 * GIB, "weights_bytes": 0}, "greater than 0"),
    ({"memory_bytes": MAX_MEMORY_BYTES, "weights_bytes": MAX_MEMORY_BYTES + 1}, "less than"),
    ({"memory_bytes": 8 * GIB, "weights_bytes": "1"}, "integer"),
])
def test_weights_bytes_is_refused_with_a_sentence(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        _spec(**fields)
