"""The optimizer's state goes through torch.distributed.checkpoint in every checkpoint (one format
for 1 and N processes); a checkpoint of the earlier format (optimizer inside trainer_state.pt)
still resumes in one process, with the same state."""

import torch

from tether.run import TRAINER_STATE, RunDir, rng_state
from tether.trainers.core.common import EpochSampler, make_optimizer, make_scheduler, restore_training, save_training


def _stepped(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = make_optimizer(model, 1e-2, 0.1)
    sched = make_scheduler(opt, "cosine", 1, 10)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert set(sa["state"]) == set(sb["state"])
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][name]), (k, name)


class _Saveable(torch.nn.Sequential):
    def save_pretrained(self, out, **_):  # RunDir writes the model through save_pretrained
        torch.save(self.state_dict(), out / "model.pt")


def test_dcp_optimizer_state_round_trips_exactly_and_the_old_format_still_loads(tmp_path):
    model, opt, sched = _stepped()
    saveable = _Saveable(*model)
    run = RunDir(tmp_path / "run")
    order = EpochSampler(10, 2, 0)
    ckpt = save_training(run, 3, saveable, None, opt, sched, order, 0, 0.0, keep_last=0)
    assert (ckpt / "optimizer").is_dir() and "optimizer" not in torch.load(ckpt / TRAINER_STATE, weights_only=False)
    fresh_model, fresh_opt, fresh_sched = _stepped(seed=1)  # other state, to be overwritten
    restore_training(ckpt, run, _Saveable(*fresh_model), fresh_opt, fresh_sched, EpochSampler(10, 2, 0))
    _same_state(opt, fresh_opt)

    # the earlier format: the optimizer's own state_dict inside trainer_state.pt, no optimizer/
    old = tmp_path / "old"
    old.mkdir()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "data_position": 0,
                "step": 3, "rng": rng_state()}, old / TRAINER_STATE)
    other_model, other_opt, other_sched = _stepped(seed=2)
    restore_training(old, run, _Saveable(*other_model), other_opt, other_sched, EpochSampler(10, 2, 0))
    _same_state(opt, other_opt)
    run.close()
