"""The answer key of the faults planted from outside the project (bench/doctor_eval/drills.py plants them): each
fault's name and the class, timeline layer and family the doctor must name; and the jobs they are planted in —
the ones a user runs (the README's default job, dense_tiny, moe_tiny, shakespeare_char) and the tiny drill model
the unit tests train in seconds. bench/doctor_eval/score.py scores the doctor against it.

Each fault acts at step S (the S-th train batch) or, for a resume fault, on the resume at S − 1; S + `lag` is the
first step at which the fault could be visible in the records.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

QUIET = ["logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "threads=1", "fault=none"]
TEXT = Path("/work/shared/data/tinyshakespeare.txt")  # real text, where the machine has it


@dataclass(frozen=True)
class Job:
    overrides: tuple      # beside QUIET: what makes the job (an experiment, its data)
    steps: int            # its own length (train.steps)
    transition: tuple = (60, 110)   # the steps of its natural transition (the copy source's induction head)
    late: tuple = (250, 380)        # a quiet stretch late in the run


# the tiny drill jobs' settings but for their depth
DRILL = ("train.eval_every=1000", "train.eval_samples=32", "train.eval_batch_size=16", "train.batch_size=8",
         "data.seq_len=32", "data.min_doc_len=4", "model.d_model=32", "model.n_heads=2",
         "optim.schedule.warmup_steps=10", "guard.detector.warmup=40", "guard=log", "optim.lr=3e-3", "data=synthetic")

JOBS = {
    "default": Job((), 400),
    "dense_tiny": Job(("+experiment=dense_tiny",), 400),
    "moe_tiny": Job(("+experiment=moe_tiny",), 400),
    # NOTE: eager (train.compile=false): inductor's cold compile would dominate a short run on a CPU
    "shakespeare_char": Job(("+experiment=shakespeare_char", f"data.path={TEXT}", "train.compile=false",
                             "train.eval_every=200", "train.eval_samples=480"), 400),
    # the tiny model the unit tests train in seconds (tests/test_doctor_unseen.py)
    "drill": Job((*DRILL, "model.n_layers=2"), 400, (60, 60), (60, 60)),
    # the same with the default model's four layers (dense, MoE, dense, MoE): the whole set (`-m sweep`), whose
    # patches reach blocks 2 and 3 as in the default job
    "drill_deep": Job((*DRILL, "model.n_layers=4"), 400, (60, 60), (60, 60)),
}


@dataclass(frozen=True)
class Fault:
    name: str
    cls: str          # the class the doctor must name
    layer: str        # the timeline layer of the earliest anomaly
    family: str = ""  # data | forward | update | moe | resume | rank | system (scored and held out together)
    lag: int = 0      # steps after S until the fault can be visible
    what: str = ""
    resume: bool = False   # planted on a resume from the checkpoint of step S - 1
    nproc: int = 1
    resume_args: tuple = ()  # hydra overrides of the resumed process only


FAULTS = [
    # data / input layer
    Fault("noise_half", "data.corrupted_batch", "input", "data", what="half the batch's tokens uniform noise"),
    Fault("repeat_quarter", "data.corrupted_batch", "input", "data", what="a quarter of the positions one token id"),
    Fault("label_shift", "data.corrupted_batch", "input", "data", what="labels shifted by one position"),
    Fault("labels_last_ignored", "data.corrupted_batch", "input", "data",
          what="step S's last target of every row (its last label not ignored) set to the ignore index in collation"),
    Fault("two_rows_swapped", "data.corrupted_batch", "input", "data",
          what="step S's rows 0 and 1 swap their tokens and labels in collation (their sample ids kept)"),
    Fault("first_tokens_swapped", "data.corrupted_batch", "input", "data",
          what="step S's rows with their first two tokens swapped in collation (labels as they were)"),
    Fault("rare_tokens", "data.corrupted_batch", "input", "data", what="10 % of inputs the padding id, never seen as input"),
    Fault("columns_truncated", "data.corrupted_batch", "input", "data",
          what="step S's batch loses its last position (tokens, labels: one column fewer) in collation, one step"),
    Fault("markov_chain_swap", "data.distribution_shift", "input", "data",
          what="from S on, the markov source's documents come from another chain (a silent data switch)"),
    Fault("cursor_repeat", "data.continuity", "input", "data", what="the loader serves the previous batch again"),
    Fault("cursor_skip", "data.continuity", "input", "data", what="the loader jumps 40 batches ahead"),
    Fault("val_leak_sustained", "forward.below_floor", "input", "data",
          what="from S on, the first 4 rows of every training batch are validation samples 0..3 (their content)"),
    Fault("labels_ignore_half", "data.corrupted_batch", "input", "data",
          what="half of step S's valid labels set to the ignore index (a mask corrupted), one step"),
    Fault("row_duplicated", "data.corrupted_batch", "input", "data",
          what="row 1 of step S's batch holds row 0's content, its sample ids unchanged, one step"),
    Fault("rows_permuted", "data.corrupted_batch", "input", "data",
          what="step S's rows rotated by one within the batch, their sample ids and sources left in place (collation)"),
    Fault("noise_slow", "data.corrupted_batch", "input", "data", what="noise share grows 4 % per step from S (slow)"),
    # forward
    Fault("act_x4_attn", "numerics.activation_outlier", "forward", "forward", what="block0.attn output ×4 for one step"),
    Fault("act_x2_mlp_sustained", "numerics.activation_outlier", "forward", "forward", what="block0.mlp output ×2 from S on"),
    Fault("act_x2_attn1_sustained", "numerics.activation_outlier", "forward", "forward",
          what="block1.attn output ×2 from S on (subtle, sustained)"),
    Fault("nan_attn", "numerics.nonfinite", "forward", "forward", what="NaN into block1.attn output for one step"),
    Fault("attn1_bf16_sustained", "numerics.precision", "forward", "forward",
          what="block1.attn output rounded to bf16 and back from S on (every value finite)"),
    # NOTE: written between two steps (as the loader serves step S's batch): the specification it breaks is the state's
    # continuity, which the continuity check names at the embedding; the outlier its forward then shows is the shadow
    Fault("emb_row_x50", "state.continuity", "backward/update", "forward",
          what="one embedding row ×50 (the copy BOS), between two steps"),
    Fault("logits_bf16_sustained", "numerics.precision", "forward", "forward",
          what="the head's logits rounded to bf16 and back from S on (every value finite)"),
    Fault("swiglu_clamp_tight", "numerics.mismatch", "forward", "forward",
          what="block0's SwiGLU clamp limit 10 → 0.3 from S on (its module's, not the config's)"),
    Fault("norm_eps_big", "numerics.mismatch", "forward", "forward",
          what="block2's attention RMSNorm ε 1e-5 → 1e-1 from S on (its module's, not the config's)"),
    Fault("emb_output_scaled", "numerics.activation_outlier", "forward", "forward",
          what="the token embedding's output ×√d_model from S on (a forward hook: a scaling the model does not have)"),
    Fault("attn_scale_d", "numerics.mismatch", "forward", "forward",
          what="block1's attention scores scaled by 1/d_head instead of 1/√d_head from S on (its kernel call)"),
    Fault("attn_bf16_kernel_sustained", "numerics.precision", "forward", "forward",
          what="block2's attention kernel runs on q, k, v rounded to bf16 from S on (every value finite)"),
    Fault("attn_window_16", "numerics.mismatch", "forward", "forward",
          what="block0's attention sees only the last 16 positions from S on (a sliding window in its kernel call)"),
    Fault("norm_gain_ignored", "numerics.mismatch", "forward", "forward",
          what="block2's MLP RMSNorm normalises without its gain from S on (its module, not the config)"),
    Fault("attn_proj_out_transposed", "numerics.mismatch", "forward", "forward",
          what="block2's attention output projection applies its weight transposed from S on (a layout bug in its call)"),
    Fault("rope_theta_x10_sustained", "numerics.mismatch", "forward", "forward",
          what="the model's RoPE tables recomputed with θ ×10 from S on (its buffers, not the config)"),
    Fault("swiglu_gelu_sustained", "numerics.mismatch", "forward", "forward",
          what="block0's SwiGLU gates with GELU instead of SiLU from S on (its module's forward)"),
    Fault("attn_sees_next", "forward.below_floor", "forward", "forward",
          what="block2's attention mask lets each position see the next one from S on (an off-by-one in its kernel call)"),
    Fault("mlp_hidden_bf16_sustained", "numerics.precision", "forward", "forward",
          what="block2's MLP hidden activation rounded to bf16 before its down projection from S on (its output FP32)"),
    Fault("attn_heads_rolled", "numerics.mismatch", "forward", "forward",
          what="block1's attention heads rolled by one before its output projection from S on (a layout bug)"),
    Fault("attn_qk_fp16_sustained", "numerics.precision", "forward", "forward",
          what="block0's attention scores from q and k rounded to fp16 from S on (every value finite, the output FP32)"),
    Fault("attn_out_fp16_sustained", "numerics.precision", "forward", "forward",
          what="block2's attention output rounded to fp16 before its output projection from S on (the projection FP32)"),
    Fault("norm_eps_1e4_sustained", "numerics.mismatch", "forward", "forward",
          what="block1's attention RMSNorm ε 1e-5 → 1e-4 from S on (its module's, not the config's)"),
    Fault("rope_theta_1pct_sustained", "numerics.mismatch", "forward", "forward",
          what="the model's RoPE tables recomputed with θ ×1.01 at S (its buffers, not the config)"),
    Fault("attn_v_bf16_sustained", "numerics.precision", "forward", "forward",
          what="block0's attention values rounded to bf16 inside its kernel call from S on (q and k FP32)"),
    Fault("swiglu_halves_swapped", "numerics.mismatch", "forward", "forward",
          what="block2's SwiGLU reads its fused projection as (up, gate) instead of (gate, up) from S on (its forward)"),
    Fault("attn_out_x098_sustained", "numerics.activation_outlier", "forward", "forward",
          what="block1's attention output ×0.98 from S on (a forward hook: a scaling the model does not have)"),
    Fault("emb_dropout_sustained", "numerics.mismatch", "forward", "forward",
          what="dropout p = 0.1 on the token embedding's output in every training forward from S on (the config has none)"),
    Fault("mlp_x2_rows_sustained", "numerics.activation_outlier", "forward", "forward",
          what="block0.mlp output ×2 on every row but the first of each micro-batch from S on (the probe's row spared)"),
    # backward / update
    Fault("grad_x50_layer", "optim.gradient_spike", "backward/update", "update", what="block1.attn gradients ×50, one step"),
    Fault("grad_x3_sustained", "optim.gradient_spike", "backward/update", "update", what="block0.attn gradients ×3 from S on"),
    Fault("grad_noise_after_backward", "optim.gradient_mismatch", "backward/update", "update",
          what="block2.attn.qkv's .grad gets noise of its own spread, written after the backward, one step"),
    Fault("lr_x3", "optim.lr_switch", "backward/update", "update", what="every LR ×3 from S on"),
    Fault("adam_v_div16", "optim.state", "backward/update", "update", what="exp_avg_sq ÷16 before the update of S"),
    Fault("wd_x10", "optim.settings", "backward/update", "update",
          what="every group's weight decay ×10 from S on (an optimizer setting changed under the config)"),
    Fault("beta2_999", "optim.settings", "backward/update", "update", what="AdamW's β2 0.95 → 0.999 from S on"),
    Fault("lr_schedule_restart", "optim.lr_switch", "backward/update", "update",
          what="the LR scheduler restarts (warm-up again) at S, mid-run, no resume"),
    Fault("adam_step_reset", "optim.state", "backward/update", "update",
          what="every AdamW state's step count reset to 0 before the update of S (bias corrections restart)"),
    Fault("beta1_zero", "optim.settings", "backward/update", "update", what="AdamW's β1 0.9 → 0 from S on"),
    Fault("no_decay_lr_zero", "optim.lr_switch", "backward/update", "update",
          what="the no_decay group's LR set to 0 from S on (norm gains, embeddings, routers frozen), the others on schedule"),
    Fault("micro_batch_twice", "optim.gradient_mismatch", "backward/update", "update",
          what="step S's first micro-batch's backward runs twice (its gradient counted twice)"),
    Fault("grad_nan_one_element", "numerics.nonfinite", "backward/update", "update",
          what="one element of block2.mlp.w_down's gradient NaN at step S (a hook)"),
    Fault("weights_halved_between", "state.continuity", "backward/update", "update",
          what="block1's attention output projection halved in place between steps S − 1 and S (outside any update)"),
    Fault("exp_avg_swapped", "optim.state", "backward/update", "update",
          what="blocks 0's and 2's attention qkv exp_avg swapped before the update of S"),
    Fault("adam_eps_big", "optim.settings", "backward/update", "update", what="AdamW's eps → 1e-3 from S on"),
    Fault("micro_batch_dropped", "optim.gradient_mismatch", "backward/update", "update",
          what="step S's second micro-batch's backward never runs (its loss counted, its gradient lost)"),
    Fault("grad_bf16_sustained", "numerics.precision", "backward/update", "update",
          what="every parameter's .grad rounded to bf16 after each accumulation from S on (every value finite)"),
    Fault("loss_all_positions", "optim.gradient_spike", "backward/update", "update",
          what="from S on, the token count the step divides its loss by counts every position, the ignored ones too"),
    Fault("exp_avg_sq_bf16_sustained", "numerics.precision", "backward/update", "update",
          what="every AdamW exp_avg_sq rounded to bf16 after each update from S on (every value finite)"),
    Fault("wd_on_no_decay", "optim.settings", "backward/update", "update",
          what="the no_decay group's weight decay set to the decay group's from S on (norm gains, embeddings decayed)"),
    Fault("grad_accum_last_only", "optim.gradient_mismatch", "backward/update", "update",
          what="step S's gradient cleared between its micro-batches: the update sees the last micro-batch's alone"),
    Fault("default_group_lr_x15", "optim.lr_switch", "backward/update", "update",
          what="the default (decayed) group's LR ×1.5 from S on, the no_decay group on schedule"),
    Fault("adam_l2_not_decoupled", "optim.settings", "backward/update", "update",
          what="from S on the weight decay is added to the gradient (Adam with an L2 term) instead of decoupled (AdamW)"),
    Fault("zero_grad_skipped", "optim.gradient_mismatch", "backward/update", "update",
          what="the zero_grad after step S − 1's update does not run: step S's backward adds onto S − 1's gradients"),
    Fault("z_loss_x10_sustained", "optim.gradient_mismatch", "backward/update", "update",
          what="the step hands the loss 10× the config's z-loss coefficient from S on (the config unchanged)"),
    Fault("weights_bf16_sustained", "numerics.precision", "backward/update", "update",
          what="block2's MLP weights rounded to bf16 after each update from S on (the master copy kept coarser)"),
    Fault("head_weight_detached", "optim.gradient_mismatch", "backward/update", "update",
          what="the head reads its (tied) weight detached from S on: the embedding gets no gradient through the head"),
    # MoE: the expert loads stay where they were
    Fault("moe_expert_out_bf16_sustained", "numerics.precision", "forward", "moe",
          what="block1's experts' outputs rounded to bf16 from S on (the recipe keeps them FP32)"),
    # NOTE: scored once as moe_router_z_on (its coefficient set to 1e-3, the config's own: a no-op) and with
    # labels_last_ignored on the last column (always ignored in the default job: a no-op); both mended after
    Fault("moe_router_z_x10", "moe.balancing", "backward/update", "moe",
          what="block1's router z-loss coefficient ×10 in its module from S on (the config's unchanged)"),
    Fault("moe_shared_expert_x2", "numerics.mismatch", "forward", "moe",
          what="the last MoE layer's (block3's) shared expert output ×2 from S on (a forward hook)"),
    Fault("moe_gates_unnormalised", "moe.routing", "forward", "moe",
          what="block1's MoE stops renormalising its top-k gates from S on (its module's setting, not the config)"),
    Fault("moe_bias_frozen", "moe.balancing", "backward/update", "moe",
          what="block1's balancing bias stops moving from S on"),
    Fault("moe_top1_sustained", "moe.routing", "forward", "moe",
          what="the last MoE layer (block3) sends each token to 1 expert from S on (its module's top_k, not the config's)"),
    Fault("moe_expert_dead", "moe.dead_expert", "forward", "moe", what="the last MoE layer's (block3's) expert 2 outputs zeros from S on"),
    Fault("moe_bias_speed_x10", "moe.balancing", "backward/update", "moe",
          what="block1's balancing bias moves 10× its configured speed from S on"),
    Fault("moe_router_jitter", "moe.routing", "forward", "moe",
          what="the last MoE layer's (block3's) router logits get N(0, 0.5²) noise in training from S on"),
    Fault("moe_bias_ignored", "moe.routing", "forward", "moe",
          what="the last MoE layer (block3) selects its experts without its balancing bias from S on"),
    Fault("moe_balance_coef_x100", "moe.balancing", "backward/update", "moe",
          what="block1's MoE balancing loss coefficient ×100 from S on (its module's setting, not the config)"),
    Fault("moe_score_sigmoid", "moe.routing", "forward", "moe",
          what="the last MoE layer (block3) scores its experts by sigmoid, not softmax, from S on (its module's setting)"),
    Fault("moe_shared_expert_off", "numerics.mismatch", "forward", "moe",
          what="the last MoE layer's (block3's) shared expert contributes nothing from S on (its output zeroed)"),
    Fault("moe_bias_stale_loads", "moe.balancing", "backward/update", "moe",
          what="block1's balancing bias moves by the previous step's loads from S on, not the step's own"),
    Fault("moe_experts_swapped_between", "state.continuity", "backward/update", "moe",
          what="block1's experts 0 and 1 swap their down projections in place between steps S − 1 and S"),
    Fault("moe_aux_dropped", "moe.balancing", "backward/update", "moe",
          what="the last MoE layer's (block3's) auxiliary loss is left out of the objective from S on"),
    Fault("moe_gates_biased", "moe.routing", "forward", "moe",
          what="block1's MoE scores carry its balancing bias from S on (the gates weighted by it, not selection only)"),
    Fault("moe_gates_unnormalised", "moe.routing", "forward", "moe",
          what="block1's MoE stops renormalising its top-k gates from S on (its module's config, not the run's)"),
    Fault("router_bf16_sustained", "numerics.precision", "forward", "moe",
          what="the last MoE layer's (block3's) router logits rounded to bf16 from S on (the recipe keeps them FP32)"),
    Fault("attn_causal_leak", "forward.below_floor", "forward", "forward",
          what="the last-but-one block's attention (block2's) stops being causal from S on (its module's flag)"),
    Fault("clip_threshold_div10", "optim.settings", "backward/update", "update",
          what="the clip threshold ÷10 from S on (the step is handed another max_grad_norm than the config's)"),
    Fault("emb_grad_zero_sustained", "optim.gradient_mismatch", "backward/update", "update",
          what="the embedding's gradient zeroed by a tensor hook from S on (a frozen embedding)"),
    # state at resume
    Fault("resume_lost_moments", "state.resume_fault", "backward/update", "resume", resume=True,
          what="resume drops Adam's m and v"),
    Fault("resume_cursor_zero", "state.resume_fault", "input", "resume", resume=True, what="resume puts the data cursor at 0"),
    Fault("resume_schedule_reset", "state.resume_fault", "backward/update", "resume", resume=True,
          what="resume restarts the LR schedule (warm-up again)"),
    Fault("resume_moe_bias_zero", "state.resume_fault", "backward/update", "resume", resume=True,
          what="resume zeroes the MoE balancing bias"),
    Fault("resume_step_count_off", "state.resume_fault", "backward/update", "resume", resume=True,
          what="resume restores every AdamW step count one higher than saved"),
    Fault("resume_cursor_ahead", "state.resume_fault", "input", "resume", resume=True,
          what="resume puts the data cursor one batch further than saved (a batch skipped)"),
    Fault("resume_config_change", "state.resume_fault", "backward/update", "resume", resume=True,
          resume_args=("optim.weight_decay=0.5",),
          what="resume with another optim.weight_decay, the resume's config check silenced (undeclared)"),
    # ranks
    Fault("rank1_other_data", "rank.data", "input", "rank", nproc=2, what="rank 1 reads samples 5000 further on"),
    Fault("rank1_grad_x3", "system.rank_divergence", "system", "rank", nproc=2,
          what="rank 1's gradient buckets ×3 before the all-reduce (a DDP communication hook), one step"),
    Fault("rank1_lr_x2", "system.rank_divergence", "system", "rank", nproc=2,
          what="rank 1's optimizer runs at twice every group's LR from S on (rank 0 on schedule)"),
    Fault("rank1_step_skipped", "system.rank_divergence", "system", "rank", nproc=2,
          what="rank 1's optimizer skips the update of step S (rank 0 applies it): the replicas part"),
    Fault("rank1_exp_avg_zeroed", "system.rank_divergence", "system", "rank", nproc=2,
          what="rank 1's AdamW exp_avg zeroed before the update of S (rank 0's kept): the replicas part"),
    Fault("rank0_param_drift", "system.rank_divergence", "system", "rank", nproc=2,
          what="rank 0's block0.mlp weights get noise after the update of S (the replicas part)"),
    # system
    Fault("slow_optimizer", "system.slow_component", "system", "system",
          what="the optimizer's step sleeps 60 ms from S on"),
    Fault("slow_loader", "system.slow_component", "system", "system", what="the loader sleeps 60 ms per batch from S on"),
]
BY_NAME = {f.name: f for f in FAULTS}
