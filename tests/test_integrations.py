"""CoMERA inside a Hugging Face ``transformers.Trainer`` through ``CoMERACallback``: a
small BERT classifier built from a config (nothing downloaded), tensorized, trained by
the Trainer's own loop to the target; its optimizer checked; evaluation left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import comera_engine as ce
from comera_engine.errors import ConfigError
from comera_engine.layers import size_report, tt_layers
from tests.test_controller import assert_truncated, run_two_processes

pytest.importorskip("transformers", reason="transformers is not installed (huggingface extra)")
pytest.importorskip("accelerate", reason="accelerate is not installed (huggingface extra)")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)

from comera_engine.integrations.huggingface import CoMERACallback  # noqa: E402

TARGET, STEPS = 8.0, 200
# the head stays dense; the pooler and the position table are TT too (the token-type
# table, 2 rows, stays dense: below tensorize's min_features)
KEEP_DENSE = ["classifier"]


class Tokens(torch.utils.data.Dataset):
    """Sequences of 16 tokens of a 64-word vocabulary; the label says whether the first
    token is in the lower half (balanced, learnable, nothing to download)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 64, (n, 16), generator=g)
        self.labels = (self.ids[:, 0] < 33).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _bert(**config) -> BertForSequenceClassification:  # noqa: ANN003
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=16, num_labels=2, **config)
    model = BertForSequenceClassification(cfg)
    ce.tensorize(model, ce.CoMERAConfig(target_compression=TARGET), exclude=KEEP_DENSE)
    return model


def _args(tmp_path, **kw) -> TrainingArguments:  # noqa: ANN001
    kw = {"save_strategy": "no", "max_steps": STEPS, **kw}
    return TrainingArguments(output_dir=str(tmp_path),
                             per_device_train_batch_size=32, report_to="none",
                             logging_steps=STEPS, use_cpu=True, disable_tqdm=True, **kw)


def test_a_trainer_with_the_callback_trains_a_bert_to_the_target(tmp_path) -> None:
    torch.set_num_threads(1)
    model = _bert()
    comera = ce.CoMERA(model, target_compression=TARGET, total_steps=STEPS, lr_cores=3e-3,
                       lr_embedding=3e-3, lr_dense=1e-3)
    opt = torch.optim.AdamW(comera.param_groups())
    used = []  # the rates each optimizer step ran at
    opt.register_step_post_hook(
        lambda o, *_: used.append({g["name"]: g["lr"] for g in o.param_groups}))
    callback = CoMERACallback(comera)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=Tokens(4000, 0),
                      optimizers=(opt, None), callbacks=[callback])
    trainer.train()
    # the Trainer's linear decay ran on every group but the gates, kept at their rate by
    # the controller's hook on the optimizer under accelerate's wrapper
    assert len(used) == STEPS and {u["gates"] for u in used} == {comera.lr_gates()}
    assert used[-1]["cores"] < 0.01 * used[0]["cores"]
    # the controller stepped after every optimizer step and landed at the target
    rep, sizes = comera.report(), size_report(model)
    assert comera.steps_done == STEPS and rep["step"] == STEPS
    assert abs(rep["compression"] / TARGET - 1) <= 0.05, rep["message"]
    assert rep["compression"] == sizes["tensorized"]["compression"]
    assert {"stage", "pace", "target_met", "truncate"} <= {e.kind for e in callback.events}
    # the rank terms went into the loss the Trainer trained on (the hook ran loss())
    assert "size_surrogate" in comera.info or "size" in comera.info
    # truncated in the Trainer's loop: live entries only, optimizer state at their shapes
    assert_truncated(model, opt)
    # evaluation sees the task loss alone, and the hook is gone after training
    test = Tokens(500, 1)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=test.ids, labels=test.labels)
    assert out.loss.item() == pytest.approx(F.cross_entropy(out.logits, test.labels).item(),
                                            rel=1e-6)
    assert not model._forward_hooks
    # it learned the rule on sequences it never saw (chance: 0.5)
    assert (out.logits.argmax(1) == test.labels).float().mean().item() > 0.9
    # saved small and rebuilt in a fresh instance of the Hugging Face class: same outputs
    ce.save(model, tmp_path / "small.safetensors")
    fresh = ce.load_into(BertForSequenceClassification(model.config),
                         tmp_path / "small.safetensors").eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=test.ids).logits, out.logits)


def _train_maybe_stopped(out, model: torch.nn.Module, comera: ce.CoMERA,  # noqa: ANN001
                         data: torch.utils.data.Dataset, steps: int, save_at: int,
                         batch: int, stop: bool, resume: str | None = None,
                         **opt: float) -> None:
    """Train ``model`` in a Trainer with ``CoMERACallback(comera)`` for ``steps``: with
    ``stop``, checkpoint at ``save_at`` and stop right after it; with ``resume``, restore
    the callback from that checkpoint first and go on from it. ``opt``: AdamW's keywords
    over ``comera.param_groups()``."""
    from transformers import TrainerCallback

    class StopAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            control.should_training_stop = True

    torch.set_num_threads(1)
    callback = CoMERACallback(comera)
    if resume:
        callback.restore(resume)
    args = TrainingArguments(output_dir=str(out), max_steps=steps, seed=0,
                             per_device_train_batch_size=batch, report_to="none",
                             save_strategy="steps" if stop else "no", save_steps=save_at,
                             logging_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(torch.optim.AdamW(comera.param_groups(), **opt), None),
                      callbacks=[callback, *([StopAfterSave()] if stop else [])])
    trainer.train(resume_from_checkpoint=resume)


def test_a_run_stopped_at_a_checkpoint_resumes_to_the_same_model(tmp_path) -> None:
    """Stopped right after the Trainer's checkpoint at step 40, while the pace prunes,
    then resumed from it into a freshly built model (``CoMERACallback.restore``, then
    ``resume_from_checkpoint``): the same ranks, controller state and outputs as the run
    that went through."""
    from comera_engine.integrations.huggingface import STATE_FILE

    steps, half = 80, 40
    data = Tokens(2000, 0)

    def run(out, stop: bool, resume: str | None = None):  # noqa: ANN001, ANN202
        model = _bert()
        comera = ce.CoMERA(model, target_compression=TARGET, total_steps=steps, switch=20,
                           lr_cores=3e-3, lr_embedding=3e-3, lr_dense=1e-3)
        _train_maybe_stopped(out, model, comera, data, steps, half, 32, stop, resume)
        return model, comera

    whole, whole_c = run(tmp_path / "whole", stop=False)
    paced = [e.step for e in whole_c.events if e.kind == "pace"]
    assert min(paced) < half < max(paced)  # the checkpoint falls mid-pruning
    _, first_c = run(tmp_path / "parts", stop=True)
    ckpt = tmp_path / "parts" / f"checkpoint-{half}"
    assert first_c.steps_done == half and (ckpt / STATE_FILE).is_file()
    resumed, resumed_c = run(tmp_path / "parts", stop=False, resume=str(ckpt))
    assert resumed_c.steps_done == whole_c.steps_done == steps
    assert resumed_c.report()["ranks"] == whole_c.report()["ranks"]
    assert resumed_c.report()["compression"] == whole_c.report()["compression"]
    assert [e.kind for e in resumed_c.events] == [e.kind for e in whole_c.events
                                                  if e.step > half]
    test = Tokens(256, 1)
    whole.eval(), resumed.eval()
    with torch.no_grad():
        a, b = whole(input_ids=test.ids).logits, resumed(input_ids=test.ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="^resume_from_checkpoint: .*comera_state.json"):
        CoMERACallback(resumed_c).restore(tmp_path / "whole")


_DDP_TRAINER = """
import json, os, sys
import torch
sys.path.insert(0, sys.argv[2])
import comera_engine as ce
from comera_engine.layers import tt_layers
from comera_engine.train.shrink import quiet_import
with quiet_import():
    from transformers import Trainer, TrainingArguments
from comera_engine.integrations.huggingface import CoMERACallback
from test_integrations import TARGET, Tokens, _bert

torch.set_num_threads(1)
steps = int(sys.argv[3])
model = _bert()  # seeded: the same initial model in both processes
comera = ce.CoMERA(model, target_compression=TARGET, total_steps=steps, switch=40,
                   lr_cores=3e-3, lr_embedding=3e-3, lr_dense=1e-3)
opt = torch.optim.AdamW(comera.param_groups())
args = TrainingArguments(output_dir=sys.argv[1], max_steps=steps, seed=0,
                         per_device_train_batch_size=16, report_to="none", save_strategy="no",
                         logging_strategy="no", use_cpu=True, disable_tqdm=True)
callback = CoMERACallback(comera)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(4000, 0),
                  optimizers=(opt, None), callbacks=[callback])
trainer.train()
rank = int(os.environ["RANK"])
state_shapes = [[list(v.shape) for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]
                for g in opt.param_groups for p in g["params"]]
out = {"world": args.world_size, "report": comera.report(), "z_f": comera.state_dict()["z_f"],
       "events": [[e.step, e.kind] for e in comera.events],
       "shapes": [list(p.shape) for g in opt.param_groups for p in g["params"]],
       "state_shapes": state_shapes,
       "masks_full": all(bool(mk.all()) for _, m in tt_layers(model) for mk in m.tt.masks()),
       "params": [float(p.detach().double().abs().sum()) for p in model.parameters()]}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(out, fh)
"""


def test_under_ddp_the_processes_agree_and_the_model_is_truncated_at_the_end(tmp_path):
    """Two gloo processes, each its own shard of the examples, in the Trainer's DDP: the
    plateau and λ judged on the loss averaged over the processes (the same ``z_f``), the
    same parameters and ranks in both, the target reached; dead entries stay masked under
    the live wrapper and are sliced out of the model and the optimizer's state once
    training ends (the only ``truncate`` event, at the last step)."""
    steps = 160
    a, b = run_two_processes(_DDP_TRAINER, tmp_path, str(steps), timeout=300)
    assert a["world"] == b["world"] == 2
    assert a["z_f"] is not None and a["z_f"] == b["z_f"]
    assert a["params"] == b["params"] and a["events"] == b["events"]
    assert a["report"]["ranks"] == b["report"]["ranks"]
    rep = a["report"]
    assert abs(rep["compression"] / TARGET - 1) <= 0.05, rep["message"]
    kinds = {kind for _, kind in a["events"]}
    assert {"stage", "pace", "target_met", "truncate"} <= kinds
    assert [s for s, kind in a["events"] if kind == "truncate"] == [steps]
    assert a["masks_full"] and all(all(s == shape for s in states) for shape, states
                                   in zip(a["shapes"], a["state_shapes"]))


@pytest.mark.parametrize("own_optimizer, setting, error", [
    (False, {}, r"^optimizers: .*comera\.param_groups\(\)"),  # AdamW over all, one rate
    (True, {"label_smoothing_factor": 0.1}, "^label_smoothing_factor: .*=0$"),
    (True, {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps",
            "save_steps": 100, "eval_steps": 100},
     "^load_best_model_at_end: .*=False$"),
    # BERT takes **kwargs: the Trainer hands it num_items_in_batch and leaves its loss unscaled
    (True, {"gradient_accumulation_steps": 2}, "^gradient_accumulation_steps: .*accepts_loss_"),
])
def test_what_the_callback_cannot_run_is_refused_before_a_step(tmp_path, own_optimizer,
                                                               setting, error) -> None:
    model = _bert()
    comera = ce.CoMERA(model, target_compression=TARGET, total_steps=STEPS)
    before = [p.detach().clone() for p in model.parameters()]
    optimizers = (torch.optim.AdamW(comera.param_groups()), None) if own_optimizer else (
        None, None)
    trainer = Trainer(model=model, args=_args(tmp_path, **setting), train_dataset=Tokens(64, 0),
                      eval_dataset=Tokens(64, 1),
                      optimizers=optimizers, callbacks=[CoMERACallback(comera)])
    with pytest.raises(ConfigError, match=error):
        trainer.train()
    assert not model._forward_hooks and comera.steps_done == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_gradient_accumulation_trains_as_the_whole_batch_does(tmp_path) -> None:
    """Two micro-batches of 16 a step (``gradient_accumulation_steps=2``; the model's loss
    its micro-batch's mean, ``accepts_loss_kwargs = False``) against one batch of 32, no
    dropout: the same model at the stage switch (the rank terms counted once a step) and
    the same plateau loss ``z_f`` (the mean of the micro-batches', not the last one's)."""
    steps = 20

    def run(batch: int, accumulate: int):  # noqa: ANN202
        torch.set_num_threads(1)
        model = _bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model.accepts_loss_kwargs = False
        comera = ce.CoMERA(model, target_compression=TARGET, total_steps=STEPS, switch=steps,
                           lr_cores=3e-3, lr_embedding=3e-3, lr_dense=1e-3)
        args = TrainingArguments(output_dir=str(tmp_path / f"b{batch}"), max_steps=steps,
                                 seed=0, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulate, report_to="none",
                                 save_strategy="no", logging_strategy="no", use_cpu=True,
                                 disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=Tokens(1000, 0),
                optimizers=(torch.optim.AdamW(comera.param_groups()), None),
                callbacks=[CoMERACallback(comera)]).train()
        return model, comera

    whole, whole_c = run(32, 1)
    acc, acc_c = run(16, 2)
    assert whole_c.steps_done == acc_c.steps_done == steps
    assert whole_c.stage == acc_c.stage == "late"
    assert acc_c.state_dict()["z_f"] == pytest.approx(whole_c.state_dict()["z_f"], rel=1e-5)
    # the same model: its outputs (an attention key bias has no true gradient, so Adam
    # moves it by rounding noise alone: parameters are not compared one by one) and gates
    test = Tokens(256, 1)
    whole.eval(), acc.eval()
    with torch.no_grad():
        a, b = whole(input_ids=test.ids).logits, acc(input_ids=test.ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for (name, a_layer), (_, b_layer) in zip(tt_layers(whole), tt_layers(acc)):
        for u, v in zip(a_layer.tt.gates, b_layer.tt.gates):
            torch.testing.assert_close(v, u, rtol=1e-4, atol=1e-5, msg=name)


def test_the_hf_trainer_example_runs_on_the_reviews_and_writes_json(tmp_path, capsys) -> None:
    """experiments/hf_trainer.py end to end, briefly (in this process): dense, fixed ranks
    and CoMERA in the Trainer on the real reviews, CoMERA at the target within ±5 %, the
    fixed-rank model within it, the JSON written; a bad flag refused."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import hf_trainer

    out_json = tmp_path / "hf_trainer.json"
    threads = torch.get_num_threads()
    try:
        assert hf_trainer.main(["--steps", "20", "--seeds", "0", "--max-examples", "2000",
                                "--out", str(out_json)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert [r["method"] for r in data["runs"]] == ["dense", "fixed-rank TT", "CoMERA"]
    dense, fixed, comera = data["runs"]
    assert abs(comera["compression"] / 10 - 1) <= 0.05, comera["message"]
    assert fixed["compression"] >= 10 and fixed["params"] < dense["params"]
    assert 0.5 < data["majority"] < 1 and data["machine"]["torch"] == torch.__version__
    assert data["data"]["max_examples"] == 2000 and data["data"]["name"] == "reviews"
    assert "target 10× (TT layers)" in out and "majority class" in out
    with pytest.raises(SystemExit):
        hf_trainer.main(["--target", "1"])
    assert "--target" in capsys.readouterr().err


def test_under_sgd_in_a_trainer_the_gates_take_their_own_adam_steps(tmp_path, capsys) -> None:
    """The Trainer wraps the optimizer in accelerate's ``AcceleratedOptimizer`` (an
    ``Optimizer`` subclass without the base's hooks): the callback hands the controller
    the SGD under it, so the gates' own Adam hooks in (said once) and steps them, SGD
    keeps no state for them, and the Trainer's linear decay leaves their rate alone. The
    Trainer's 10 steps are not the controller's budget: said before the first."""
    torch.set_num_threads(1)
    model = _bert()
    comera = ce.CoMERA(model, target_compression=TARGET, total_steps=STEPS)
    opt = torch.optim.SGD(comera.param_groups(), lr=0.05, momentum=0.9)
    gates = [m.tt.gate for _, m in tt_layers(model)]
    before = [g.detach().clone() for g in gates]
    used = []
    opt.register_step_post_hook(
        lambda o, *_: used.append({g["name"]: g["lr"] for g in o.param_groups}))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=10, seed=0,
                             per_device_train_batch_size=32, report_to="none",
                             save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens(320, 0), optimizers=(opt, None),
            callbacks=[CoMERACallback(comera)]).train()
    assert comera.steps_done == 10 and len(used) == 10
    assert {u["gates"] for u in used} == {comera.lr_gates()}
    assert all(not torch.equal(g.detach(), b) for g, b in zip(gates, before))
    assert not any(opt.state.get(g) for g in gates)  # SGD passed over them
    said = capsys.readouterr().err
    assert said.count(f"ce.CoMERA(total_steps={STEPS:,}) but the Trainer runs 10 steps: "
                      "the ranks are planned to reach the target within total_steps, so this "
                      "run ends short of it") == 1


def _gpt2() -> torch.nn.Module:
    """A two-layer GPT-2 built from its config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=48, n_head=4, vocab_size=300, n_positions=32,
                        bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0,
                        resid_pdrop=0.0)
    return GPT2LMHeadModel(config)


def test_gpt2s_layers_become_tt_and_compute_what_they_did(tmp_path) -> None:
    """GPT-2's linears are Hugging Face ``Conv1D`` (``x·W + b``, ``W`` ``(in, out)``) and
    its head is tied to the token table: ``tensorize`` makes the linears and the tables
    TT and the head decodes through the TT table. From the pretrained weights at full
    rank (TT-SVD is then exact) the model gives the original's logits; a tied head kept
    dense under a TT table is refused; a save loads into a fresh GPT-2, tie included."""
    import comera_engine as ce
    from comera_engine.errors import ConfigError
    from comera_engine.layers import tt_layers
    from comera_engine.layers.tied import TiedDecoder

    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    original = _gpt2().eval()
    with pytest.raises(ConfigError, match="'lm_head' is tied to 'transformer.wte'"):
        ce.tensorize(_gpt2(), ce.CoMERAConfig(target_compression=4), exclude=["lm_head"])
    model = ce.tensorize(_gpt2(), ce.CoMERAConfig(), rank=300, from_pretrained=True).eval()
    names = [n for n, _ in tt_layers(model)]
    assert names == ["transformer.wte", "transformer.wpe"] + [
        f"transformer.h.{i}.{part}" for i in range(2)
        for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert isinstance(model.lm_head, TiedDecoder)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits,
                                   rtol=1e-4, atol=1e-4)
    small = ce.tensorize(_gpt2(), ce.CoMERAConfig(target_compression=4)).eval()
    path = tmp_path / "gpt2.safetensors"
    ce.save(small, path)
    loaded = ce.load_into(_gpt2(), path).eval()
    assert loaded.lm_head.embedding is loaded.transformer.wte
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, small(ids).logits)


def test_a_tied_gpt2_stopped_in_a_trainer_resumes_to_the_same_model(tmp_path) -> None:
    """A GPT-2 language model (its head tied to the TT table) stopped at the Trainer's
    checkpoint while the pace prunes and resumed into a freshly built GPT-2
    (``CoMERACallback.restore``): the tie is there again, and the ranks and logits are
    those of the run that went through."""
    from comera_engine.layers.tied import TiedDecoder

    steps, half = 40, 12

    class Text(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 300, (640, 12), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def run(out, stop: bool, resume: str | None = None):  # noqa: ANN001, ANN202
        model = _gpt2()
        model.accepts_loss_kwargs = False
        config = ce.CoMERAConfig(target_compression=4, switch=5)
        ce.tensorize(model, config)
        comera = ce.CoMERA(model, config, total_steps=steps)
        _train_maybe_stopped(out, model, comera, Text(), steps, half, 16, stop, resume,
                             lr=3e-3)
        return model, comera

    whole, whole_c = run(tmp_path / "whole", stop=False)
    paced = [e.step for e in whole_c.events if e.kind == "pace"]
    assert min(paced) < half < max(paced)  # the checkpoint falls mid-pruning
    run(tmp_path / "parts", stop=True)
    resumed, resumed_c = run(tmp_path / "parts", stop=False,
                             resume=str(tmp_path / "parts" / f"checkpoint-{half}"))
    assert isinstance(resumed.lm_head, TiedDecoder)
    assert resumed.lm_head.embedding is resumed.transformer.wte
    assert resumed_c.report()["ranks"] == whole_c.report()["ranks"]
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    whole.eval(), resumed.eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids).logits, whole(ids).logits, rtol=1e-5,
                                   atol=1e-5)


def test_t5_ties_its_tables_and_barts_scaled_tables_stay_dense(tmp_path) -> None:
    """T5 holds one token table three times (``shared``, the encoder's, the decoder's)
    and ties its head to it; BART's tables are subclasses that scale their output (and
    offset the positions). At full rank from the pretrained weights (exact TT-SVD) both
    give the original's logits: T5's table is one TT table in all three places, BART's
    stay dense (a plain TT table would drop the scale); a T5 save loads into a fresh T5."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    import comera_engine as ce
    from comera_engine.layers.tied import TiedDecoder

    def t5() -> torch.nn.Module:
        torch.manual_seed(0)
        return T5ForConditionalGeneration(T5Config(
            vocab_size=120, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            decoder_start_token_id=0, dropout_rate=0.0))

    def bart() -> torch.nn.Module:
        torch.manual_seed(0)
        return BartForConditionalGeneration(BartConfig(
            vocab_size=120, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
            scale_embedding=True))

    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    for build in (t5, bart):
        original = build().eval()
        model = ce.tensorize(build(), ce.CoMERAConfig(), rank=200, from_pretrained=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, labels=ids).logits,
                                       original(input_ids=ids, labels=ids).logits,
                                       rtol=1e-4, atol=1e-4)
    assert model.model.shared.__class__.__name__ == "BartScaledWordEmbedding"  # BART's
    small = ce.tensorize(t5(), ce.CoMERAConfig(target_compression=4)).eval()
    assert small.shared is small.encoder.embed_tokens is small.decoder.embed_tokens
    assert isinstance(small.lm_head, TiedDecoder)
    path = tmp_path / "t5.safetensors"
    ce.save(small, path)
    loaded = ce.load_into(t5(), path).eval()
    assert loaded.shared is loaded.decoder.embed_tokens
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, labels=ids).logits,
                                   small(input_ids=ids, labels=ids).logits)
