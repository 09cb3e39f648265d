"""The memory plan from the compiled programs (CPU: ``memory_analysis`` works there too)."""

from __future__ import annotations

import jax
import pytest
from flax import nnx
from jax._src import compilation_cache, monitoring

from osworld_jax.batch import route_dtype
from osworld_jax.model import ModelRuntimeConfig, Policy
from osworld_jax.model.tiny import tiny_config, tiny_vl_config
from osworld_jax.trainer import OptimizerConfig, Trainer
from osworld_jax.trainer.program_memory import (
    TRAIN_KNOB,
    MemoryPlan,
    MemoryPlanError,
    Pool,
    ProgramMemory,
    abstract_batch,
    colocated_pool,
    device_bytes,
    trainer_pool,
    trainer_programs,
)
from tests.trainer._tiny import BOUNDS, make_batch, make_policy, trainer_config


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The tiny text trainer's plan compiled into a fresh persistent cache, then its first real
    step (of the planned shape) with the compilation-cache events it raised."""
    old = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    seen: list[str] = []
    try:
        policy = make_policy()
        trainer = Trainer(trainer_config(), policy, bounds=BOUNDS)
        programs = trainer_programs(trainer, rows=8, lengths=[16])
        init = trainer.init_state()
        batch = make_batch(policy)  # routes in the packed batch's dtype (int8 here)
        batch = batch._replace(routed_experts=batch.routed_experts.astype(route_dtype(4)))

        def listen(name: str, *_: object, **__: object) -> None:
            seen.append(name)

        monitoring.register_event_listener(listen)
        monitoring.register_event_duration_secs_listener(listen)
        try:
            trainer.train_step(init, batch)
        finally:
            monitoring.unregister_event_listener(listen)
            monitoring.unregister_event_duration_listener(listen)
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
        compilation_cache.reset_cache()
    return trainer, programs, seen


def test_the_plan_is_the_compiled_step_and_the_run_reuses_it(planned):
    trainer, [prog], seen = planned
    # The plan's numbers are the compiled program's own.
    m = trainer.lower("train_step", abstract_batch(trainer.model, 8, 16)).compile()
    m = m.memory_analysis()
    assert (prog.arguments, prog.outputs, prog.aliased, prog.temp) == (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
    )
    state = device_bytes(trainer.abstract_state)
    assert prog.persistent == state
    # The donated state is written in place (every state byte aliased); the arguments are the
    # state and the batch (XLA drops a field the step never reads).
    assert prog.aliased == state
    batch = device_bytes(abstract_batch(trainer.model, 8, 16))
    assert state < prog.arguments <= state + batch
    assert prog.peak == prog.arguments + prog.outputs - prog.aliased + prog.temp + prog.code
    assert prog.temp > 0
    # The run's first step of that shape ran the plan's executable (in this process: the
    # jitted function's own; in another: loaded from the persistent cache), never compiled it.
    assert "/jax/compilation_cache/cache_misses" not in seen
    compiles = seen.count("/jax/core/compile/backend_compile_duration")
    assert compiles <= seen.count("/jax/compilation_cache/cache_hits")


IDS = {"<|vision_start|>": 120, "<|vision_end|>": 121, "<|image_pad|>": 122, "<|video_pad|>": 123}
# One LM layer and one ViT block: the smallest tower that still trains.
TEXT = tiny_config(128, 1, moe_intermediate_size=48, num_hidden_layers=1, mlp_only_layers=())
VL = tiny_vl_config(TEXT, IDS, vision={"depth": 1, "deepstack_visual_indexes": ()})
RUNTIME = ModelRuntimeConfig(dtype="float32", expert_backend="dense")


def test_a_frozen_tower_lowers_the_steps_figure():
    policy = nnx.eval_shape(lambda: Policy(VL, RUNTIME, rngs=nnx.Rngs(0)))

    def step(freeze: bool) -> ProgramMemory:
        opt = OptimizerConfig(freeze_vision=freeze)
        trainer = Trainer(trainer_config(optimizer=opt), policy, bounds=BOUNDS)
        [prog] = trainer_programs(trainer, rows=2, lengths=[16], patch_buckets=[4])
        assert prog.name == "train_step 2x16 4p"
        return prog

    trained, frozen = step(False), step(True)
    # No moments for the tower (a smaller state) and no tower gradients (less temp).
    assert frozen.persistent < trained.persistent
    assert frozen.transient < trained.transient
    assert frozen.peak < trained.peak


def prog(name: str, stream: str, transient: int, persistent: int = 100) -> ProgramMemory:
    return ProgramMemory(
        name=name, stream=stream, arguments=persistent + 10, outputs=transient - 10,
        aliased=0, temp=0, code=0, persistent=persistent, knob=f"{name}'s knob",
    )  # fmt: skip


def test_pools_count_persistent_buffers_once_and_add_concurrent_streams():
    train = Pool(
        name="trainer",
        capacity=None,
        persistent=(("train state", 100),),
        programs=(prog("train_step a", "trainer", 50), prog("train_step b", "trainer", 70)),
    )
    serve = Pool(
        name="server",
        capacity=None,
        persistent=(("weights", 30), ("KV cache", 20)),
        programs=(prog("prefill 64", "server", 40, 50), prog("decode 8", "server", 5, 50)),
        reserve=7,
    )
    assert train.need == 100 + 70  # one program at a time: the largest transient
    assert serve.need == 50 + 40 + 7
    apart = colocated_pool(train, serve, capacity=None, overlap=False)
    together = colocated_pool(train, serve, capacity=None, overlap=True)
    assert apart.need == 150 + 7 + 70  # k = 0: the step and the rollout never overlap
    assert together.need == 150 + 7 + 70 + 40  # k >= 1: a step and a prefill at once


def test_a_too_small_device_is_refused_in_one_line_naming_the_program(planned):
    trainer, programs, _ = planned
    fits = trainer_pool(trainer, programs, capacity=None)
    MemoryPlan((fits,)).check()  # unknown capacity: nothing to refuse
    small = trainer_pool(
        trainer, programs, capacity=fits.need - 1, capacity_knob="a smaller server share"
    )
    with pytest.raises(MemoryPlanError) as e:
        MemoryPlan((small,)).check()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("memory plan: the trainer pool needs")
    assert f"train_step 8x16 peaks at {programs[0].peak / 2**30:.2f} GiB" in msg
    assert TRAIN_KNOB in msg and "a smaller server share" in msg
    table = MemoryPlan((fits,)).table()
    assert table[1].startswith("train_step 8x16") and table[-1].startswith("pool trainer")
