"""``LLM(path, tensor_parallel_size=2)``: rank 0 in this process, rank 1 started by the
LLM itself, each reading its shard of the seeded local checkpoint. Greedy and seeded
sampled texts equal the one-process LLM's; streaming and stop strings go through the
same engine thread; close() stops rank 1 and leaves no process group behind; under
torchrun every process constructs the LLM and rank 1 follows; bad sizes and
unsupported options are refused by name before any rank starts."""

import pytest

from atbcore.errors import CapabilityError, ParamsError

PROMPTS = ["the quick brown fox", "hello world, this is", "one two three four five six",
           "the lazy dog"]  # two of one length: batched together on the ranks


@pytest.fixture(scope="module")
def tp_llm(ckpt):
    from atb_torch.llm import LLM

    llm = LLM(ckpt, tensor_parallel_size=2, max_model_len=64)
    yield llm
    llm.close()


def test_tp2_text_equals_one_process_text(tp_llm, llm):
    assert tp_llm.is_driver and tp_llm.rank == 0 and isinstance(tp_llm, type(llm))
    want = llm.generate_outputs(PROMPTS, max_new_tokens=20)
    got = tp_llm.generate_outputs(PROMPTS, max_new_tokens=20)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=30, top_p=0.95, seed=5)
    assert tp_llm.generate(PROMPTS, **kw) == llm.generate(PROMPTS, **kw)
    assert tp_llm.generate(PROMPTS[0], max_new_tokens=20) == want[0].text


def test_tp2_streams_and_stops_like_one_process(tp_llm, llm):
    text = llm.generate(PROMPTS[1], max_new_tokens=16)
    streamed = "".join(ev.text for ev in tp_llm.stream(PROMPTS[1], max_new_tokens=16))
    assert streamed == text
    stop = text[3:5]
    assert tp_llm.generate(PROMPTS[1], max_new_tokens=16, stop=stop) == \
        llm.generate(PROMPTS[1], max_new_tokens=16, stop=stop)


def test_the_server_serves_a_tp_llm_like_a_one_process_one(tp_llm, llm):
    """What `atb serve --tensor-parallel 2` serves: the OpenAI client gets the
    one-process text, also streamed, and n=2 sampled choices."""
    from atb_torch.llm.server import Served, build_app
    from serve_server import RunningServer

    s = RunningServer(build_app(lambda: Served(tp_llm, "tiny-tp"))).wait_ready()
    try:
        c = s.client()
        ref = llm.generate_outputs(PROMPTS[2], max_new_tokens=10)[0]
        r = c.completions.create(model="tiny-tp", prompt=PROMPTS[2], max_tokens=10,
                                 temperature=0)
        assert r.choices[0].text == ref.text
        chunks = list(c.completions.create(model="tiny-tp", prompt=PROMPTS[2], max_tokens=10,
                                           temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == ref.text
        r = c.completions.create(model="tiny-tp", prompt=PROMPTS[0], max_tokens=6,
                                 temperature=0.9, seed=4, n=2)
        want = llm.generate_outputs([PROMPTS[0]] * 2, max_new_tokens=6, temperature=0.9, seed=4)
        assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == \
            [o.text for o in want]
        assert s.metric("atb_kv_blocks_total") == 0  # no paged cache on this path
    finally:
        s.stop()


def test_one_tp_llm_at_a_time_per_process(tp_llm, ckpt):
    from atb_torch.llm import LLM

    with pytest.raises(CapabilityError, match="another tensor-parallel LLM"):
        LLM(ckpt, tensor_parallel_size=2)


def test_length_limit_then_close_stops_the_ranks_and_the_group(tp_llm):
    import torch.distributed as dist

    procs = list(tp_llm._procs)
    assert tp_llm.max_model_len == 64 and len(procs) == 1 and procs[0].is_alive()
    out = tp_llm.generate_outputs("one two", max_new_tokens=200, ignore_eos=True)[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 64
    tp_llm.close()
    assert not procs[0].is_alive() and procs[0].exitcode == 0
    assert not dist.is_initialized()


TORCHRUN_SCRIPT = """
import json, sys
from atb_torch.llm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2)   # rank 1 follows rank 0 in here
if llm.is_driver:
    print("TEXT", json.dumps(llm.generate(sys.argv[2:], max_new_tokens=12)))
    llm.close()
else:
    print("FOLLOWED", llm.rank)
"""


def test_under_torchrun_rank_0_drives_and_rank_1_follows(ckpt, llm, tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script), str(ckpt), *PROMPTS[:2]],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    text = json.loads(next(ln for ln in lines if ln.startswith("TEXT "))[5:])
    assert text == llm.generate(PROMPTS[:2], max_new_tokens=12)
    assert "FOLLOWED 1" in lines


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_bad_sizes_are_refused(ckpt, bad):
    from atb_torch.llm import LLM

    with pytest.raises(ParamsError, match="tensor_parallel_size"):
        LLM(ckpt, tensor_parallel_size=bad)


def test_what_the_tp_path_does_not_run_is_refused_by_name(ckpt, hf):
    from atb_torch.llm import LLM

    with pytest.raises(CapabilityError, match="attention heads"):
        LLM(ckpt, tensor_parallel_size=3)  # 4 heads do not split over 3 ranks
    with pytest.raises(CapabilityError, match="quantize"):
        LLM(ckpt, tensor_parallel_size=2, quantize="w8")
    with pytest.raises(CapabilityError, match="enable_speculative"):
        LLM(ckpt, tensor_parallel_size=2, enable_speculative=True)
    with pytest.raises(CapabilityError, match="checkpoint directory"):
        LLM(hf[0], tokenizer=hf[1], tensor_parallel_size=2)
