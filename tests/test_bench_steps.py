"""`tandem bench steps` on the CPU: target, verify, draft step and the draft's chain, with their operator tables."""
import torch

from tandem.bench_steps import measure, random_models

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            q_lora_rank=32, kv_lora_rank=32, intermediate_size=128, moe_intermediate_size=32)


def test_steps_and_the_chain_are_timed_with_their_operators():
    torch.set_num_threads(1)
    target, draft, raw = random_models(TINY, "cpu", torch.float32)
    assert raw["num_hidden_layers"] == 2 and raw["hidden_size"] == 64
    r = measure(target, draft, "cpu", batch=2, context=16, k=3, iters=2, graphs=False, kernels=True)
    assert all(r[f"{n}_ms"] > 0 for n in ("target", "verify", "draft", "chain"))
    assert abs(r["chain_step_over_target"] - r["chain_ms"] / 3 / r["target_ms"]) < 1e-9
    tables = r["kernels"]
    assert set(tables) == {"target", "verify", "draft", "chain"}
    for name, table in tables.items():
        names = [key for key, _, _ in table]
        assert "aten::mm" in names, name                                  # every step multiplies matrices
        assert all(n > 0 and us > 0 for _, n, us in table)
        assert [us for *_, us in table] == sorted((us for *_, us in table), reverse=True)
    mm = {name: dict((key, n) for key, n, _ in table)["aten::mm"] for name, table in tables.items()}
    assert mm["chain"] > mm["draft"]          # three heads and two MTP steps against one of each
    assert mm["target"] > mm["draft"]         # two layers and a dense MLP against one MTP layer
