"""The embedded backbone's injected experience comes from the memory pipeline itself.

``training.backbone.pretraining_experience`` distils the build's trajectories into a real LanceDB
memory with the stage pipeline (outline distiller, the embedding model) and retrieves with
``training_experience``, as a stage's training does: the ``top_k`` nearest *other* cards.

    pytest tests/ray/test_backbone_experience.py -q
"""

from __future__ import annotations

import numpy as np
from test_memory_pipeline import _trajectories  # tests/ray is on sys.path (no packages)

from hamo_ray.backbones.toy import pretraining_experience
from hamo_ray.config import load_config
from hamo_ray.memory import Embedder, get_distiller
from hamo_ray.types import key_text


def test_experience_is_the_pipelines_retrieval_never_the_own_card(ray_session, tmp_path):
    # An LLM distiller in the run's config must not be used: no endpoint exists before the backbone.
    cfg = load_config(
        None, ["memory.top_k=2", "memory.distiller=llm", "memory.llm_base_url=http://127.0.0.1:9"]
    )
    trajs = _trajectories()
    experience = pretraining_experience(trajs, cfg, tmp_path / "memory", fraction=1.0, seed=0)
    assert set(experience) == {t.id for t in trajs}
    vectors = Embedder().embed([key_text(t.goal, t.init_obs) for t in trajs])
    sims = vectors @ vectors.T
    np.fill_diagonal(sims, -np.inf)
    outlines = dict(zip((t.id for t in trajs), get_distiller("outline").distill(trajs), strict=True))
    for i, t in enumerate(trajs):
        cards = experience[t.id]
        assert len(cards) == 2 and t.card_id not in {c.id for c in cards}
        assert all(c.outline == outlines[c.trajectory_id] for c in cards)
        # the nearest other cards by cosine (ties aside: compare similarities, not ids)
        expected = np.sort(sims[i])[::-1][:2]
        got = sorted(
            (float(sims[i][[x.id for x in trajs].index(c.trajectory_id)]) for c in cards), reverse=True
        )
        np.testing.assert_allclose(got, expected, atol=1e-4)
    # fraction picks a seeded share
    half = pretraining_experience(trajs, cfg, tmp_path / "memory2", fraction=0.5, seed=0)
    assert 0 < len(half) < len(trajs)
    assert half == pretraining_experience(trajs, cfg, tmp_path / "memory3", fraction=0.5, seed=0)
