"""The decode step compiled ahead of time (meshlm.generate.ahead, `meshlm generate --aot`): its
greedy tokens are the eager decoder's, with left padding, through a second generation (a new cache
bound to the same library) and from the library kept on disk (refused where another user could
have written it); it holds no weights of its own (the model's tensors are read in place). The
CLI's --aot: tests/test_compiled.py."""
import stat

import pytest
from conftest import build, tiny

from meshlm.errors import ConfigError
from meshlm.generate import Sampling, ahead, generate

PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]  # left padding in the batch


@pytest.mark.slow
def test_aot_greedy_tokens_are_the_eager_decoders_fresh_and_from_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(ahead, "cache_dir", lambda: tmp_path / "cache")
    model = build(tiny(spec="1+2R3+1", d_model=64, vocab_size=256, context_length=96,
                       scheme="mesh"))
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    eager = generate(model, PROMPTS, s)
    assert generate(model, PROMPTS, s, compile="aot") == eager
    (step,) = ahead._STEPS[model].values()
    assert not step.loaded and len(list((tmp_path / "cache" / "aot").glob("step-*.pt2"))) == 1
    assert generate(model, PROMPTS, s, compile="aot") == eager  # a new cache, the same library
    # the library reads the model's own tensors: every weight it names is the model's, not a copy
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    named = [n for n in step.names if n in weights]
    assert named and all(step.constants[n].data_ptr() == weights[n].data_ptr() for n in named)
    ahead._STEPS.clear()
    assert generate(model, PROMPTS, s, compile="aot") == eager
    assert ahead._STEPS[model][next(iter(ahead._STEPS[model]))].loaded  # from the disk
    # a library another user could have replaced is refused, not loaded
    (library,) = (tmp_path / "cache" / "aot").glob("step-*.pt2")
    library.chmod(library.stat().st_mode | stat.S_IWOTH)
    ahead._STEPS.clear()
    with pytest.raises(ConfigError, match="could have been written by another user"):
        generate(model, PROMPTS, s, compile="aot")
    library.chmod(library.stat().st_mode & ~stat.S_IWOTH)
