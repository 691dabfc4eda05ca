"""DSpark's loss in chunks of valid rows (`chunked_dspark_loss`) against its plain form on every slot's logits
at once (`dspark_loss`, the reference, itself matched to DeepSpec's golden tensors in tests/test_dspark.py):
the loss, its three terms, the acceptance statistic and the gradient of every trainable parameter of a tiny
drafter, in fp32, for chunks that split the rows unevenly and one chunk that holds them all, each term's
weight switched off in turn, without a confidence head, without a Markov head, with the logit scaling and
cap, and with no valid row. Then the memory: the chunked form keeps for backward less than one
[T, V] fp32 tensor, where the plain form keeps several. Last, the chunk's elementwise work compiled (GPU
training's path, here through CPU inductor): the functional form equals the in-place one, the compiled loss
the eager one, and the trainer compiles it exactly when it compiles DFlash's.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn

import dflash_compile
import dflash_loss
from dflash_compile import COMPILE_LOCK_DIR_ENV
from dflash_loss import block_target_hidden, chunked_dspark_loss, dspark_loss
from dflash_loss_kernels import dspark_terms_and_grad_chunk, dspark_terms_and_grad_chunk_functional
from dspark_model import DSparkConfig, DSparkDraftModel, dspark_block_labels, markov_predecessor_ids

GAMMA, HIDDEN = 4, 32


def tiny_drafter(vocab=64, markov_rank=8, confidence=True, dflash_config=None, hidden_size=HIDDEN) -> DSparkDraftModel:
    """A 1-layer DSpark drafter in fp32 with the target's (frozen) embedding and LM head attached."""
    torch.manual_seed(0)
    config = DSparkConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=GAMMA,
        num_target_layers=4,
        markov_rank=markov_rank,
        enable_confidence_head=confidence,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [1, 3], **(dflash_config or {})},
    )
    drafter = DSparkDraftModel(config).float()
    for module in (drafter.markov_head, drafter.confidence_head):  # away from DeepSpec's near-zero init, so each term moves
        for param in [] if module is None else module.parameters():
            nn.init.normal_(param, std=0.3)
    embed, lm_head = nn.Embedding(vocab, hidden_size), nn.Linear(hidden_size, vocab, bias=False)
    nn.init.normal_(lm_head.weight, std=0.5)
    drafter.attach_target(embed.requires_grad_(False), lm_head.requires_grad_(False))
    return drafter


def micro_batch(drafter, holes=True):
    """A micro-batch's blocks: (hidden [2, 6, gamma, H] from the drafter's forward, predecessors, labels, label_valid,
    target_hidden [2, 6, gamma, H]), with holes in the loss mask and blocks cut by the sequence end."""
    vocab, seq = drafter.config.vocab_size, 20
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab - 1, (2, seq), generator=generator)
    loss_mask = torch.zeros(2, seq, dtype=torch.bool)
    loss_mask[:, 3:] = True
    if holes:
        loss_mask[0, 12] = loss_mask[1, 9] = False
    anchors = torch.tensor([[2, 5, 8, 11, 15, 18], [3, 4, 7, 10, 14, 17]])
    anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
    anchor_valid[1, 5] = False
    features = torch.randn(2, seq, 2 * drafter.config.hidden_size, generator=generator)
    hidden = drafter(features, input_ids, anchors, anchor_valid, attention_backend="sdpa")  # [2, 6, gamma, H]
    labels, label_valid = dspark_block_labels(input_ids, loss_mask, anchors, anchor_valid, GAMMA)
    predecessors = markov_predecessor_ids(input_ids, anchors, GAMMA)
    target_hidden = block_target_hidden(torch.randn(2, seq, drafter.config.hidden_size, generator=generator), anchors, GAMMA + 1)
    return hidden, predecessors, labels, label_valid, target_hidden


def reference(drafter, batch, **weights):
    """The plain reference: `dspark_loss` on all slots' logits at once, and the acceptance counted on them: (loss, terms, accepted)."""
    hidden, predecessors, labels, label_valid, target_hidden = batch
    logits = drafter.block_logits(hidden, predecessors)  # [batch, N, gamma, V]
    confidence = drafter.confidence_logits(hidden, predecessors) if drafter.confidence_head is not None else None
    with torch.no_grad():
        target_logits = drafter.compute_logits(target_hidden)
    loss, terms = dspark_loss(logits, confidence, labels, label_valid, target_logits, **weights)
    correct = logits.detach().argmax(dim=-1) == labels
    accepted = (correct.to(torch.int32).cumprod(dim=-1).bool() & label_valid).sum(dim=(0, 1)).float()
    return loss, terms, accepted / label_valid.sum(dim=(0, 1)).float()


def chunked(drafter, batch, chunk_size, **weights):
    hidden, predecessors, labels, label_valid, target_hidden = batch
    confidence = drafter.confidence_logits(hidden, predecessors) if drafter.confidence_head is not None else None
    markov = drafter.markov_head
    return chunked_dspark_loss(
        hidden,
        predecessors,
        drafter.target_lm_head.weight,
        labels,
        label_valid,
        target_hidden,
        confidence,
        markov_w1=None if markov is None else markov.markov_w1.weight,
        markov_w2=None if markov is None else markov.markov_w2.weight,
        chunk_size=chunk_size,
        output_multiplier=drafter.config.output_multiplier,
        final_logit_softcapping=drafter.config.final_logit_softcapping,
        **weights,
    )


def gradients(drafter, loss) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (a parameter left out of the graph fails here: ZeRO needs all of them)."""
    params = {name: param for name, param in drafter.named_parameters() if param.requires_grad}
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def assert_equal_to_reference(drafter, chunk_size, holes=True, **weights):
    expected_loss, expected_terms, expected_accepted = reference(drafter, micro_batch(drafter, holes), **weights)
    expected_grads = gradients(drafter, expected_loss)
    loss, terms, accepted = chunked(drafter, micro_batch(drafter, holes), chunk_size, **weights)
    grads = gradients(drafter, loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    for name in ("ce", "l1", "bce"):
        torch.testing.assert_close(terms[name], expected_terms[name], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(accepted, expected_accepted, rtol=0, atol=0, equal_nan=True)
    for name, expected in expected_grads.items():
        scale = expected.abs().max().item()
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-6 * max(scale, 1e-6), msg=lambda m, n=name: f"{n}: {m}")
    return expected_loss, expected_grads


@pytest.mark.parametrize("chunk_size", [7, 1000])
@pytest.mark.parametrize(
    "weights",
    [
        {},  # the recipe's 0.1 CE + 0.9 L1 + 1.0 BCE
        {"ce_weight": 0.0},
        {"l1_weight": 0.0},
        {"confidence_weight": 0.0},
        {"ce_weight": 0.0, "l1_weight": 0.0},  # BCE alone: the logits get no gradient, the confidence head does
        {"ce_weight": 0.5, "l1_weight": 0.0, "confidence_weight": 0.0},  # no target distribution needed
    ],
)
def test_chunked_equals_the_plain_loss(chunk_size, weights):
    drafter = tiny_drafter()
    expected_loss, grads = assert_equal_to_reference(drafter, chunk_size, **weights)
    assert expected_loss.item() > 0.05
    assert int(micro_batch(drafter)[3].sum()) == 33  # T of 48 slots: 7 rows a chunk leave a partial chunk of 5
    moved = {name for name, grad in grads.items() if grad.abs().max() > 0}
    # Each head's parameters move exactly when a term reaches them: a gradient that the check would miss is not zero here.
    assert ("markov_head.markov_w2.weight" in moved) == (weights.get("ce_weight", 0.1) > 0 or weights.get("l1_weight", 0.9) > 0)
    assert ("confidence_head.proj.weight" in moved) == (weights.get("confidence_weight", 1.0) > 0)


@pytest.mark.parametrize(
    "drafter_kwargs",
    [{"confidence": False}, {"markov_rank": 0, "confidence": False}, {"dflash_config": {"output_multiplier": 0.7, "final_logit_softcapping": 2.5}}],
    ids=["no_confidence_head", "no_markov_head", "scaled_and_capped"],
)
@pytest.mark.parametrize("chunk_size", [7, 1000])
def test_chunked_equals_the_plain_loss_across_heads_and_logit_caps(drafter_kwargs, chunk_size):
    assert_equal_to_reference(tiny_drafter(**drafter_kwargs), chunk_size)


def test_accepted_counts_the_runs_of_argmax_hits_as_the_plain_logits_do():
    """With most labels set to the drafter's own argmax, blocks run right for a few slots: the chunked form's
    acceptance (hits found chunk by chunk) equals the one counted on all slots' logits."""
    drafter = tiny_drafter()
    hidden, predecessors, labels, label_valid, target_hidden = micro_batch(drafter)
    with torch.no_grad():
        argmax = drafter.block_logits(hidden, predecessors).argmax(dim=-1)  # [batch, N, gamma]
    keep = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3)) < 0.75
    batch = (hidden, predecessors, torch.where(keep, argmax, (argmax + 1) % drafter.config.vocab_size), label_valid, target_hidden)
    _, _, expected = reference(drafter, batch)
    _, _, accepted = chunked(drafter, batch, 7)
    torch.testing.assert_close(accepted, expected, rtol=0, atol=0)
    print(f"accepted {accepted.tolist()}")
    assert 0.5 < accepted[0] and 0 < accepted[-1] < accepted[0]


def test_no_valid_row_gives_zero_with_every_parameter_in_the_graph():
    drafter = tiny_drafter()
    hidden, predecessors, labels, label_valid, target_hidden = micro_batch(drafter)
    nothing = (hidden, predecessors, labels, torch.zeros_like(label_valid), target_hidden)
    loss, terms, accepted = chunked(drafter, nothing, 7)
    assert loss.item() == 0.0 and loss.requires_grad
    assert all(value.item() == 0.0 for value in terms.values()) and accepted.isnan().all()
    grads = gradients(drafter, loss)
    assert all(grad.abs().max() == 0 for grad in grads.values())


def test_a_valid_index_found_ahead_and_no_grad_give_the_same_loss():
    drafter = tiny_drafter()
    batch = micro_batch(drafter)
    loss, terms, _ = chunked(drafter, batch, 7)
    ahead, _, _ = chunked(drafter, batch, 7, valid_index=batch[3].nonzero())
    torch.testing.assert_close(ahead, loss, rtol=0, atol=0)
    with torch.no_grad():
        evaluated, _, _ = chunked(drafter, batch, 7)
    assert not evaluated.requires_grad
    torch.testing.assert_close(evaluated, loss.detach(), rtol=0, atol=0)


def saved_bytes(compute) -> int:
    """Bytes of the tensors autograd keeps for backward while `compute()` builds its graph."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compute()
    loss.backward()  # the graph is whole
    return total


def test_the_chunked_loss_keeps_no_vocab_sized_tensor_for_backward():
    """At T = 64 valid rows and V = 4096 one [T, V] fp32 tensor is 1 MiB, far more than everything else the
    loss keeps (hidden rows, Markov rows, W2's gradient [V, r]): the chunked form stays below it, the plain
    form (its logits' softmaxes) above."""
    vocab = 4096
    drafter = tiny_drafter(vocab=vocab, hidden_size=16)
    hidden = torch.randn(2, 8, GAMMA, 16, requires_grad=True)
    generator = torch.Generator().manual_seed(2)
    predecessors = torch.randint(0, vocab, (2, 8, GAMMA), generator=generator)
    labels = torch.randint(0, vocab, (2, 8, GAMMA), generator=generator)
    label_valid = torch.ones(2, 8, GAMMA, dtype=torch.bool)
    target_hidden = torch.randn(2, 8, GAMMA, 16, generator=generator)
    batch = (hidden, predecessors, labels, label_valid, target_hidden)
    one_logits_tensor = 64 * vocab * 4

    chunked_bytes = saved_bytes(lambda: chunked(drafter, batch, 16)[0])
    plain_bytes = saved_bytes(lambda: reference(drafter, batch)[0])
    print(f"saved for backward: chunked {chunked_bytes} B, plain {plain_bytes} B, one [T, V] fp32 {one_logits_tensor} B")
    assert chunked_bytes < one_logits_tensor < plain_bytes


# ----------------------------------------------------------------------------------------------
# The chunk's elementwise work, compiled


@pytest.mark.parametrize("markov", [True, False], ids=["markov", "no_markov"])
@pytest.mark.parametrize("with_l1", [True, False], ids=["l1", "no_l1"])
@pytest.mark.parametrize("scaling", [(1.0, None), (0.7, 2.5)], ids=["plain", "scaled_and_capped"])
def test_functional_chunk_equals_the_in_place_chunk(markov, with_l1, scaling):
    """What `compiled_dspark_chunk` compiles computes what the eager in-place chunk does, from bf16 logits as on a
    GPU (checked eagerly here): CE, L1, argmax hits and both gradients, the Markov term's and the head logits'."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 9, 64
    logits = (3 * torch.randn(rows, vocab, generator=g)).bfloat16()
    markov_logits = torch.randn(rows, vocab, generator=g).bfloat16() if markov else None
    target_logits = (3 * torch.randn(rows, vocab, generator=g)).bfloat16() if with_l1 else None
    targets = torch.randint(0, vocab, (rows,), generator=g)
    ce_coef, l1_coef = torch.rand(rows, generator=g), torch.rand(rows, generator=g)
    inputs = (logits, markov_logits, target_logits, targets, ce_coef, l1_coef, *scaling)
    eager = dspark_terms_and_grad_chunk(*inputs)
    functional = dspark_terms_and_grad_chunk_functional(*inputs)
    for name, a, b in zip(("ce", "l1", "hit", "dmarkov", "dlogits"), functional, eager):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert eager[-1].dtype == torch.bfloat16 and eager[-1].abs().max() > 0.01


@pytest.fixture(scope="module")
def compile_lock_dir(tmp_path_factory):
    """The compile lock in a folder of this module's (not the shared inductor cache's, which other processes lock)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(COMPILE_LOCK_DIR_ENV, str(tmp_path_factory.mktemp("compile_lock")))
        yield


@pytest.mark.parametrize(
    "drafter_kwargs, weights",
    [
        ({}, {}),  # the recipe: Markov head, L1, confidence head
        ({"dflash_config": {"output_multiplier": 0.7, "final_logit_softcapping": 2.5}}, {}),
        ({"markov_rank": 0, "confidence": False}, {"ce_weight": 0.5, "l1_weight": 0.0, "confidence_weight": 0.0}),  # CE alone: no target
    ],
    ids=["recipe", "scaled_and_capped", "ce_without_markov"],
)
def test_compiled_loss_equals_the_eager_loss_and_compiles_once(compile_lock_dir, drafter_kwargs, weights):
    """chunked_dspark_loss(compiled=True): the eager loss, terms, acceptance and every gradient; its one graph
    compiles under the lock, and other chunk sizes (dynamic rows) compile nothing more."""
    drafter = tiny_drafter(**drafter_kwargs)
    results, graphs = {}, {}
    for compiled, chunk_size in ((False, 7), (True, 7), (True, 1000)):
        compiles = dflash_compile.flex_compile_stats()["compiles"]
        loss, terms, accepted = chunked(drafter, micro_batch(drafter), chunk_size, compiled=compiled, **weights)
        results[compiled, chunk_size] = loss, terms, accepted, gradients(drafter, loss)
        assert dflash_compile.flex_compile_stats()["compiles"] - compiles == (compiled and chunk_size == 7)
        graphs[compiled, chunk_size] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs[True, 1000] == graphs[True, 7] > graphs[False, 7]  # 33 rows in one chunk: no new graph
    expected_loss, expected_terms, expected_accepted, expected_grads = results[False, 7]
    for loss, terms, accepted, grads in (results[True, 7], results[True, 1000]):
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
        for name in ("ce", "l1", "bce"):
            torch.testing.assert_close(terms[name], expected_terms[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(accepted, expected_accepted, rtol=0, atol=0, equal_nan=True)
        for name, expected in expected_grads.items():
            scale = expected.abs().max().item()
            torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-5 * max(scale, 1e-6), msg=lambda m, n=name: f"{n}: {m}")
    assert expected_grads["markov_head.markov_w2.weight" if drafter.markov_head is not None else "layers.0.mlp.down_proj.weight"].abs().max() > 0


@pytest.mark.parametrize("attention_backend, compile_drafter", [("auto", "auto"), ("flex", "auto"), ("sdpa", "on"), ("flex", "off")])
def test_the_trainer_compiles_dsparks_loss_chunk_when_it_compiles_dflashs(monkeypatch, attention_backend, compile_drafter):
    """MicroBatchLoss runs DSpark's chunks through `compiled_dspark_chunk` exactly when it gives DFlash's
    weighted_block_loss compiled=True: --compile_drafter on, or auto with flex attention (resolved on a CPU here)."""
    from test_model import tiny_drafter as tiny_dflash_drafter

    import train_dflash
    from train_dflash import MicroBatchLoss, TrainSettings, resolve_compute

    dspark_chunks, dflash_compiled = [], []

    def compiled_chunk_spy(*args, **kwargs):  # the eager chunk behind it: nothing compiles here
        dspark_chunks.append(args[0].shape)
        return dspark_terms_and_grad_chunk(*args, **kwargs)

    def weighted_block_loss_spy(*args, **kwargs):
        dflash_compiled.append(kwargs["compiled"])
        return weighted_block_loss(*args, **{**kwargs, "compiled": False})

    weighted_block_loss = train_dflash.weighted_block_loss
    monkeypatch.setattr(dflash_loss, "compiled_dspark_chunk", compiled_chunk_spy)
    monkeypatch.setattr(train_dflash, "weighted_block_loss", weighted_block_loss_spy)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 60, (2, 20), generator=g)
    loss_mask = torch.ones(2, 20, dtype=torch.bool)
    loss_mask[:, :4] = False
    for drafter in (tiny_drafter(), tiny_dflash_drafter(block_size=GAMMA)):
        config = drafter.config
        name = "dspark" if isinstance(config, DSparkConfig) else "dflash"
        settings = TrainSettings(
            target_model="x",
            train_data=["x"],
            drafter=name,
            num_anchors=4,
            block_size=GAMMA,
            attention_backend=attention_backend,
            compile_drafter=compile_drafter,
        )
        compute = resolve_compute(settings, torch.device("cpu"))
        compute = dataclasses.replace(compute, backend="sdpa")  # the drafter's forward through SDPA (flex has no CPU backward)
        width = (len(config.target_layer_ids) + (name == "dspark")) * config.hidden_size  # DSpark: + the target's last hidden state
        features = torch.randn(2, 20, width, generator=g)
        weights = None if name == "dspark" else dflash_loss.loss_weights(GAMMA)  # DSpark weighs its slots itself
        loss_fn = MicroBatchLoss(settings, config, compute, weights, drafter.target_lm_head)
        loss, _ = loss_fn(drafter, features, input_ids, loss_mask, input_ids, (0, 0, 0, 0))
        assert loss.item() > 0
    assert dflash_compiled == [compile_drafter == "on" or (compile_drafter == "auto" and attention_backend == "flex")]
    assert bool(dspark_chunks) == dflash_compiled[0]
