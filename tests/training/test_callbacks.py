"""`sft.training.callbacks.Callback` answers every event of `transformers.TrainerCallback` as it does (a no-op),
without importing transformers, and Trainer's own callback handler drives a controller built on it."""

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from sft.training.callbacks import Callback
from sft.training.controllers.guard import TrainingGuard


def test_every_event_of_trainer_callback_is_a_no_op_of_callback(tmp_path):
    events = [name for name in dir(TrainerCallback) if name.startswith("on_")]
    assert len(events) > 15  # transformers' events, as it defines them
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    for name in events:
        assert getattr(Callback(), name)(args, TrainerState(), TrainerControl()) is None, name
    assert not hasattr(Callback(), "state_dict_of_nothing")  # only events are answered


def test_trainers_callback_handler_calls_a_controller_on_every_event(tmp_path):
    guard = TrainingGuard()
    handler = CallbackHandler([guard], model=None, processing_class=None, optimizer=None, lr_scheduler=None)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    for name in (n for n in dir(TrainerCallback) if n.startswith("on_") and n != "on_init_end"):
        event = getattr(handler, name, None)
        if event is None:
            continue
        kwargs = {"metrics": {}} if name in ("on_evaluate", "on_predict") else {"logs": {}} if name == "on_log" else {}
        assert isinstance(event(args, state, control, **kwargs), TrainerControl), name
    assert handler.callback_list == "TrainingGuard"
