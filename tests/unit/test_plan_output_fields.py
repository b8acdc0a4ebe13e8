"""What a plan says it planned for: the model shape with its dropout, the precision,
the implementation, and which peak MFU is over."""

import json

from partita.cli import main

GPT3 = ("--model-shape", "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048,flavour=gpt2")
GPT3_RUN = ["--gpus", "384", "--gpu-type", "A100-80GB", "--global-batch", "1536",
            "--layout", "dp=4 tp=8 pp=12"]


def test_model_shape_dropout_is_a_filled_in_default(capsys):
    assert main(["plan", *GPT3, *GPT3_RUN, "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert ("dropout=0 (--model-shape without dropout; it sets the dropout masks' memory "
            "and time)") in data["defaults_filled_in"]
    assert data["model_shape"] == {
        "layers": 96, "hidden": 12288, "ffn": 49152, "heads": 96, "kv_heads": 96,
        "vocab": 51200, "padded_vocab": 51200, "seq": 2048, "flavour": "gpt2",
        "qkv_bias": False, "tie": True, "dropout": 0.0, "experts": None}
    # Given, it is part of the shape the first line states, and no default.
    assert main(["plan", GPT3[0], GPT3[1] + ",dropout=0.1", *GPT3_RUN]) in (0, 1)
    out = capsys.readouterr().out
    assert "gpt2 flavour, tied embeddings, dropout 0.1)" in out.splitlines()[0]
    assert "dropout=0 " not in out


def test_precision_and_implementation_are_stated(capsys):
    argv = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--precision",
            "bf16-fp32-grads", "--implementation", "partita", "--fix", "tp=1,pp=1"]
    assert main([*argv, "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["precision"] == "bf16-fp32-grads"
    assert data["precision_bytes_per_param"] == {"param": 2, "grad": 4, "master": 4,
                                                 "optimizer": 8, "activation": 2}
    assert data["implementation"] == "partita"
    assert data["model_shape"]["experts"] == {"num_experts": 8, "top_k": 2,
                                              "expert_ffn": 14336, "moe_every": 1,
                                              "shared_experts": 0}
    assert main(argv) in (0, 1)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("; precision bf16-fp32-grads")


def test_fp32_mfu_names_its_peak(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--layout",
            "dp=8 zero_stage=3 recompute=full"]
    assert main([*argv, "--precision", "fp32"]) in (0, 1)
    assert ("MFU and HFU are over H100's fp32 peak, 67.0 TFLOP/s (fp32 matmuls do not run "
            "on the 16-bit tensor cores), not its 16-bit peak of 989.0 TFLOP/s."
            ) in capsys.readouterr().out
    assert main([*argv, "--precision", "fp32", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["mfu_peak_flops"] == 67e12
    assert main(argv) in (0, 1)
    assert "MFU and HFU are over" not in capsys.readouterr().out  # the 16-bit peak
