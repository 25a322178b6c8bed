"""verify's own logic, in one process: the error metric, --plans parsing, check names."""

from __future__ import annotations

import pytest
import torch

from autopart import AutopartError
from autopart.parity.verify import FLOOR, Check, parse_plans, rel_error


def test_round_off_in_a_zero_gradient_is_not_an_error_but_a_real_one_is() -> None:
    largest = 0.25  # the model's largest gradient entry
    zero = torch.full((8,), 3e-18, dtype=torch.float64)  # a key bias: zero up to round-off
    assert rel_error(-zero, zero) == pytest.approx(2.0)  # without a floor: "200 % wrong"
    assert rel_error(-zero, zero, FLOOR * largest) < 1e-12
    small = torch.full((8,), 1e-6, dtype=torch.float64)  # small but real: an error shows
    assert rel_error(small * 1.01, small, FLOOR * largest) > 1e-9
    big = torch.ones(8, dtype=torch.float64)  # above the floor the metric is plain relative
    assert rel_error(big * (1 + 1e-7), big, FLOOR * largest) == pytest.approx(1e-7)


def test_plans_parse_into_checks_and_print_back() -> None:
    checks = parse_plans(
        "tp=2; pp=2,1f1b,m=4 ;dp=2,tp=2,pp=2,seq1f1b,k=2,m=2,sp,uniform;",
        "x:make",
        {"microbatches": 2},
    )
    assert [str(c) for c in checks] == [
        "tp=2,1f1b,m=2",
        "pp=2,1f1b,m=4",
        "dp=2,tp=2,pp=2,seq1f1b,m=2,k=2,uniform,sp",
    ]
    assert checks[2] == Check(
        "x:make",
        dp=2,
        tp=2,
        pp=2,
        schedule="seq1f1b",
        microbatches=2,
        seq_chunks=2,
        seq_split="uniform",
        sequence_parallel=True,
    )
    assert parse_plans(str(checks[2]), "x:make") == [checks[2]]  # a name reads back as its plan
    for text in (  # every word: a Check's name reads back as the same Check
        "pp=2,seq1f1b,k=2,m=2,measured",
        "pp=2,seq1f1b-interleaved,v=2,k=4,m=4,balanced",
        "tp=2,pp=2,zb-h1,m=4,recompute=selective,sp",
        "pp=2,1f1b,m=2,mem=1.5,recompute=full,attention=flex",
    ):
        (check,) = parse_plans(text, "x:make")
        assert parse_plans(str(check), "x:make") == [check], str(check)
    for bad, said in (
        ("tp=two", "needs a number"),
        ("pp=2,fast", "cannot read 'fast'"),
        (" ; ", "no plan"),
        ("pp=2,sp", "needs tensor parallelism"),  # a Check's Plan is checked as it is read
    ):
        with pytest.raises(AutopartError) as err:
            parse_plans(bad, "x:make")
        assert said in err.value.message
        assert "dp=N" in (err.value.hint or "") or "tp ≥ 2" in (err.value.hint or "")


class _Islands(torch.nn.Module):
    """A float64 model with float32 inside: ``kind`` "norm-stats" (Llama's RMSNorm: statistics
    in float32, token by token), "weight" (Gemma's: the weight cast to float32), "scalar"
    (DiffLlama's float32 lambda from parameters), "scores" (GPT-J's float32 products)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.w, self.lam = torch.nn.Parameter(torch.ones(16)), torch.nn.Parameter(torch.ones(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if self.kind == "norm-stats":
            var = x.float().pow(2).mean(-1, keepdim=True)
            x = self.w * (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype)
        elif self.kind == "weight":
            x = (x.float() * self.w.float()).to(x.dtype)
        elif self.kind == "scalar":
            x = x * torch.exp(self.lam.sum(-1, dtype=torch.float32)).to(x.dtype)
        else:
            x = (x.float() @ x.float().transpose(1, 2)).softmax(-1).to(x.dtype) @ x
        return self.head(x)


@pytest.mark.parametrize(
    ("kind", "found"), [("norm-stats", False), ("weight", True), ("scalar", True), ("scores", True)]
)
def test_islands_are_where_a_plan_can_move_lower_precision_round_off(kind, found) -> None:
    """Token-by-token float32 (Llama's norm statistics) rounds alike in every plan and keeps
    the float64 tolerance; a float32 parameter, a float32 value from parameters, or float32
    products/softmax set float32's."""
    from autopart.frontend.capture import capture
    from autopart.parity.verify import islands

    ids = torch.randint(0, 50, (2, 8))
    got = islands(capture(_Islands(kind).double(), (ids, ids)).graph, torch.float64)
    assert bool(got) == found, got
    assert all(i.endswith("(float32)") for i in got)


def test_a_model_that_fails_on_one_device_is_named_not_a_traceback() -> None:
    """A batch the model itself cannot take (a sequence longer than GPT-2's position table) used
    to end ``autopart verify`` in a raw ``IndexError`` from the reference run."""
    from autopart.models import zoo
    from autopart.parity.verify import _prepare

    def make():
        model, _ = zoo.make("gpt2", max_position_embeddings=16)
        return model, zoo.batch(seq=32)

    with pytest.raises(AutopartError, match="fails on one device with its example batch") as exc:
        _prepare(make, "float64")
    assert "input_ids (4, 32)" in str(exc.value) and "IndexError" in str(exc.value)
    assert "max_position_embeddings" in str(exc.value)


def test_a_hugging_face_factorys_labels_may_be_its_own_input_ids() -> None:
    """transformers' own tests pass ``labels = input_ids`` (HF shifts them inside); ``verify``
    took them for targets and every plan was refused inside the ranks ("labels equal
    input_ids"). A factory's batch is now shifted for a Hugging Face model whose labels plainly
    read that way (HF's loss pairs logits at t with labels[:, t + 1]: the same pairs); other
    models' labels, and labels that read both ways, are left as given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopart.frontend.spec import build
    from autopart.models import nanogpt

    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, -3:] = -100
    _, (got_ids, got) = build(lambda: (hf, (ids, labels)))
    assert torch.equal(got_ids, ids)
    assert torch.equal(got[:, :-1], labels[:, 1:]) and bool((got[:, -1] == -100).all())
    _, fields = build(lambda: (hf, {"input_ids": ids, "labels": ids.clone()}))
    assert torch.equal(fields["labels"][:, :-1], ids[:, 1:])
    same = torch.full((2, 12), 5)  # one token repeated: reads both ways, left alone
    assert torch.equal(build(lambda: (hf, (same, same.clone())))[1][1], same)
    gpt, _ = nanogpt.make()
    assert torch.equal(build(lambda: (gpt, (ids, ids.clone())))[1][1], ids)
