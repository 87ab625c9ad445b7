#!/usr/bin/env bash
# The GPU measurements that benchmarks/RESULTS.md still lacks, in stages that each fit one
# 10-minute command on a lent H100/H200 (the GPU machine has jax, flax, optax, orbax, torch and
# transformers; only first-contact needs gin-config, see below).
#
# Usage, from the repository root on the GPU machine:
#   benchmarks/gpu_session.sh STAGE [OUT_DIR]        (OUT_DIR defaults to benchmarks/results/gpu)
# Stages:
#   kernels       GPU tests (the Pallas kernels: Triton, and the Mosaic Hopper forward and
#                 backward; the offloading remat policies; the streamed optimizer update), then
#                 the kernel table at D=128, S=4K and 16K, all implementations incl. ours_mosaic
#   kernels-more  the kernel table at D=128 S=64K, and at D=64 S=4K,16K,64K
#   step-1b       llama3.2-1b training step at 64K tokens (MFU), attention by our Triton
#                 kernels, our Mosaic kernels and cuDNN
#   step-1b-memory  the same step (Triton kernels) with the memory options: remat groups of 4;
#                 bfloat16 parameters with float32 master weights, on the device and
#                 streamed from the host, and the layer parameters on the host too (what each
#                 costs in step time)
#   memory-1b     longest trainable sequence per memory configuration, llama3.2-1b
#   memory-8b     the same for llama3.1-8b (the 500K / 1M-token targets), float32 parameters,
#                 remat per layer and per group of 4 layers (by ulysses_jax.plan nothing
#                 fits one 80 GB GPU; 164K / 492K tokens one H200)
#   memory-8b-bf16  bfloat16 parameters and moments (on the host, streamed), the planner's
#                 best remat groups, with the layer parameters and gradients on the host too
#                 or not (the planner's 557K / 393K tokens on an H100)
#   memory-8b-master  bfloat16 parameters with float32 master weights and moments (on the
#                 host, streamed); the planner's 164K (H100) / 459K (H200) tokens
#                 The memory stages search by the GPU compiler's memory analysis against the
#                 allocator's limit (one real step at 500K tokens of an 8B model takes longer
#                 than a command may run) and time real steps up to --time-max-tokens. The 8B
#                 searches start at 128K or 256K tokens to save compiles.
#   peers         ulysses_jax vs transformers + PyTorch, llama3.2-1b, with --find-max
#   speed         (about 8 minutes) the attention kernel table of ours (Mosaic) and cuDNN at
#                 head dims 64 and 128, causal and full, 16K and 64K; the llama3.2-1b
#                 training step at 65,536 tokens with the shipped GPU settings
#                 (configs/runs/gpu.gin): MFU against the measured and the datasheet peak,
#                 and the same step recomputing attention's forward (--no-keep-attention);
#                 the profile of that step by class (benchmarks/profile_step.py), and of
#                 the step at 16K; and
#                 ulysses_jax vs transformers at 16K, 32K, 64K (a side out of memory is a row
#                 marked OOM). It runs issue 47's step first, then its profile, vs
#                 transformers, the kernel table, the recomputing step and the 16K profile (an
#                 H200, 2026-11-28: the step and vs transformers took 3.5 minutes together).
#   sweep-d64-causal, sweep-d64-full, sweep-d128  (each about 5 minutes, an estimate) every
#                 Mosaic attention tile of kernels.mosaic_tiles.candidates at 16K tokens
#                 (two or three compute warpgroups, 64/128-wide streamed blocks, 2-4 slots,
#                 the forward and dq with and without ping-pong, the forward with its
#                 intra-warpgroup overlap) beside the table's and cuDNN; ends with the
#                 winners as rows of kernels.mosaic_tiles.TABLE, written into
#                 ulysses_jax/kernels/mosaic_tiles.py (the stages after it run them; commit the
#                 file with the sweep's JSON)
#   sweep-d64-dkv  (about 3.5 minutes: an H200 took 12 s a tile) the same for the causal
#                 head-dim-64 dk/dv tiles only, those accumulating dq (no dq kernel) first: run
#                 before speed, whose 1B step then runs the winner. Every sweep writes the
#                 table after each row (the fastest tiles that ran) and copies it into OUT_DIR
#   generate      (over 5 minutes: an H200's 185 s ran only the float32 check, 67 s, and part
#                 of transformers' first case) benchmarks/generate_gpu.py: Llama-3.2-1B and
#                 3.1-8B shapes, random weights, 32K and 128K prompts, batch 1 and 8, beside
#                 transformers' generate and the HBM and compute floors; and each model's
#                 decode at the longest prompt whose weights and cache fit the GPU
#   generate-ours  the same, ours alone at batch 1, without transformers or the longest row
#   doctor        python -m ulysses_jax.doctor: the kernels against the dense reference and
#                 their speed beside cuDNN, the decode kernel over 8K to 1M slots beside the
#                 copy bandwidth with its variants (docs/get-started/first-gpu-run.md); an
#                 H200 took 190 s for the kernel rows at 4K and 16K alone
#   decode        the doctor's decode rows alone (--no_kernels --no_step)
#   profile-decode  (about 2 minutes, an estimate) where a decode step's time goes
#                 (benchmarks/profile_decode.py): Llama-3.2-1B, one row of 32K and of 128K
#                 cache slots (an H200 measured 1.7 ms a token above the HBM floor at both)
#   first-contact  a user's path through the real commands for every shipped GPU config cut
#                 to one GPU (benchmarks/first_contact.py): ulysses-train a few steps, SIGTERM
#                 and resume, ulysses-evaluate, ulysses-generate, ulysses-export and
#                 transformers loading the export, ulysses-doctor; ends with one table.
#                 FIRST_CONTACT_MODE=cpu runs it on the CPU with tiny shapes (the test does);
#                 FIRST_CONTACT_CONFIGS=a.gin,b.gin chooses the configs (default: all).
# GPU_SESSION_DRY=1 runs the speed, sweep, generate, doctor and profile-decode stages on the
# CPU with tiny shapes (a check of the commands, tests/test_speed_tools.py); PYTHON names the
# interpreter (default python3).
# Each stage writes JSON, PNG and a log per command into OUT_DIR; copy them into
# benchmarks/results/ and record the tables in RESULTS.md next to the command that made them.
# The commands read gin files and may log to TensorBoard, and the GPU machine lacks gin-config
# and tensorboardX: carry their wheels in .whl/ (on a connected machine: pip download
# --no-deps --dest .whl gin-config tensorboardX), and the stages that need them install them
# from there, without a network, into OUT_DIR/site.
set -uo pipefail
stage=${1:?"usage: benchmarks/gpu_session.sh STAGE [OUT_DIR]"}
out=${2:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
dry=${GPU_SESSION_DRY:-0}
if [[ $dry == 1 ]]; then  # one CPU device, as one GPU; the caller's other XLA flags kept (the
  # tests' faster CPU compiles: tests/child_env.py)
  flags=()
  for flag in ${XLA_FLAGS:-}; do
    [[ $flag == --xla_force_host_platform_device_count=* ]] || flags+=("$flag")
  done
  export JAX_PLATFORMS=cpu XLA_FLAGS="${flags[*]} --xla_force_host_platform_device_count=1"
fi

run() {  # run NAME ARGS...: one command, its output also in OUT_DIR/NAME.log
  local name=$1; shift
  echo "+ $*" | tee "$out/$name.log"
  "$@" 2>&1 | tee -a "$out/$name.log" || failed+=("$name")
}
failed=()

need_gin() {
  "$python" -c 'import gin, tensorboardX' 2>/dev/null && return
  # --no-deps: tensorboardX's numpy, packaging and protobuf are on the GPU machine already
  "$python" -m pip install --quiet --no-index --no-deps --find-links .whl --target "$out/site" \
    gin-config tensorboardX || { echo "gin-config/tensorboardX missing: put their wheels" \
    "in .whl/ (see the top of this script)" >&2; exit 2; }
  export PYTHONPATH="$PYTHONPATH:$out/site"
}

case $stage in
  kernels)
    run gpu_tests env JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/test_flash_attention.py \
      tests/test_llama.py tests/test_train_step.py -q -m gpu
    run kernels_d128 python3 -m benchmarks.attention_kernels --head-dims 128 \
      --seq-lens 4096,16384 --json "$out/attention_kernels_d128.json" ;;
  kernels-more)
    run kernels_d128_64k python3 -m benchmarks.attention_kernels --head-dims 128 \
      --seq-lens 65536 --json "$out/attention_kernels_d128_64k.json"
    run kernels_d64 python3 -m benchmarks.attention_kernels --head-dims 64 \
      --seq-lens 4096,16384,65536 --json "$out/attention_kernels_d64.json" ;;
  step-1b)
    for backend in pallas pallas_mosaic cudnn; do
      run "step_1b_64k_$backend" python3 -m benchmarks.train_step --preset llama3.2-1b \
        --seq-len 65536 --backend "$backend" --json "$out/train_step_1b_64k_$backend.json"
    done ;;
  step-1b-memory)
    common=(--preset llama3.2-1b --seq-len 65536 --backend pallas --steps 3)
    run step_1b_64k_group4 python3 -m benchmarks.train_step "${common[@]}" --remat-group 4 \
      --json "$out/train_step_1b_64k_group4.json"
    run step_1b_64k_master python3 -m benchmarks.train_step "${common[@]}" \
      --param-dtype bfloat16 --master-weights --json "$out/train_step_1b_64k_master.json"
    run step_1b_64k_master_offload python3 -m benchmarks.train_step "${common[@]}" \
      --param-dtype bfloat16 --master-weights --offload-optimizer \
      --json "$out/train_step_1b_64k_master_offload.json"
    run step_1b_64k_master_offload_params python3 -m benchmarks.train_step "${common[@]}" \
      --param-dtype bfloat16 --master-weights --offload-optimizer --offload-params \
      --json "$out/train_step_1b_64k_master_offload_params.json" ;;
  memory-1b)
    run max_seqlen_1b python3 -m benchmarks.max_seqlen --preset llama3.2-1b \
      --criterion compiled --granularity 16384 --time-max-tokens 131072 \
      --configs none,full,full+opt,offload+opt+mlp2048,full_offload+opt+mlp2048 \
      --json "$out/max_seqlen_1b.json" --plot "$out/max_seqlen_1b.png" ;;
  memory-8b)
    run max_seqlen_8b python3 -m benchmarks.max_seqlen --preset llama3.1-8b \
      --criterion compiled --granularity 32768 --time-max-tokens 65536 --max-len 2097152 \
      --start-len 262144 \
      --configs full_offload+opt+mlp2048,full_offload+group4+opt+mlp2048 \
      --json "$out/max_seqlen_8b.json" --plot "$out/max_seqlen_8b.png" ;;
  memory-8b-bf16)
    run max_seqlen_8b_bf16 python3 -m benchmarks.max_seqlen --preset llama3.1-8b \
      --criterion compiled --granularity 32768 --time-max-tokens 65536 --max-len 2097152 \
      --start-len 262144 --param-dtype bfloat16 \
      --configs full_offload+group4+opt+params+mlp2048,full_offload+group2+opt+mlp2048 \
      --json "$out/max_seqlen_8b_bf16.json" --plot "$out/max_seqlen_8b_bf16.png" ;;
  memory-8b-master)
    run max_seqlen_8b_master python3 -m benchmarks.max_seqlen --preset llama3.1-8b \
      --criterion compiled --granularity 32768 --time-max-tokens 65536 --max-len 2097152 \
      --start-len 131072 --param-dtype bfloat16 \
      --configs full_offload+group4+opt+master+mlp2048 \
      --json "$out/max_seqlen_8b_master.json" --plot "$out/max_seqlen_8b_master.png" ;;
  peers)
    run vs_transformers python3 -m benchmarks.vs_transformers --preset llama3.2-1b \
      --seq-lens 4096,8192,16384 --find-max --json "$out/vs_transformers.json" \
      --plot "$out/vs_transformers.png" ;;
  speed)
    # One compilation cache: the recomputing step and later runs reuse what they can.
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache_speed}
    if [[ $dry == 1 ]]; then
      kernel_sizes=(--tiny); preset=tiny; lens=(256); peers=(--preset tiny-gqa
        --seq-lens 64,128)
    else
      # The profile at 16K too: the length of the 1.4x goal against transformers.
      kernel_sizes=(--head-dims 64,128 --seq-lens 16384,65536)
      preset=llama3.2-1b; lens=(65536 16384)
      peers=(--preset llama3.2-1b --seq-lens 16384,32768,65536)
    fi
    settings=(--run-settings configs/runs/gpu.gin)
    step=(--preset "$preset" --seq-len "${lens[0]}" "${settings[@]}")
    profile() {
      run "speed_profile_$1" "$python" -m benchmarks.profile_step --preset "$preset" \
        --seq-len "$1" "${settings[@]}" --json "$out/speed_profile_$1.json"
    }
    # Issue 47's goal (the step's TFLOP/s) and where its time goes first, so that a call cut
    # short by its limit has them; the ratio to transformers next (two H200 sessions measured
    # 1.31-1.34 at 16K and 32K: this stage's step and the ratio took 3.5 minutes there).
    run speed_train_step "$python" -m benchmarks.train_step "${step[@]}" --steps 3 \
      --json "$out/speed_train_step.json"
    profile "${lens[0]}"
    run speed_vs_transformers "$python" -m benchmarks.vs_transformers "${peers[@]}" \
      --memory-policies full --repeats 2 --json "$out/speed_vs_transformers.json"
    run speed_kernels "$python" -m benchmarks.attention_kernels "${kernel_sizes[@]}" \
      --impls ours_mosaic,cudnn --json "$out/speed_kernels.json"
    # The same step recomputing attention's forward in the backward, beside it (the ratio).
    run speed_train_step_recompute "$python" -m benchmarks.train_step "${step[@]}" --steps 3 \
      --no-keep-attention --json "$out/speed_train_step_recompute.json"
    for len in "${lens[@]:1}"; do profile "$len"; done ;;
  sweep-d64-causal|sweep-d64-dkv|sweep-d64-full|sweep-d128)
    impls='ours_mosaic,cudnn,mosaic_*'
    case $stage in
      sweep-d64-causal) head_dim=64 masks=causal ;;
      sweep-d64-dkv) head_dim=64 masks=causal impls='ours_mosaic,mosaic_dkv*'
        # The dk/dv kernels accumulating dq first where this JAX builds them (0.11 or newer):
        # no GPU has run them yet, and an H200's 120 s ran 8 of the 16 tiles.
        "$python" -c 'from ulysses_jax.kernels import flash_hopper_backward as b
raise SystemExit(not b.can_accumulate_dq())' &&
          impls='ours_mosaic,mosaic_dkv*accumulate_dq],mosaic_dkv*' ;;
      sweep-d64-full) head_dim=64 masks=full ;;
      *) head_dim=128 masks=causal,full ;;
    esac
    if [[ $dry == 1 ]]; then sizes=(--tiny); else sizes=(--seq-lens 16384); fi
    run "$stage" "$python" -m benchmarks.attention_kernels "${sizes[@]}" --head-dims "$head_dim" \
      --masks "$masks" --sweep --write-table --impls "$impls" --json "$out/$stage.json"
    # The table as the sweep left it (after each row: the fastest tiles that ran), to commit.
    cp ulysses_jax/kernels/mosaic_tiles.py "$out/" ;;
  generate)
    if [[ $dry == 1 ]]; then sizes=(--tiny); else sizes=(); fi
    run generate_gpu "$python" -m benchmarks.generate_gpu "${sizes[@]}" --longest \
      --json "$out/generate_gpu.json" ;;
  generate-ours)
    if [[ $dry == 1 ]]; then sizes=(--tiny); else sizes=(); fi
    run generate_gpu "$python" -m benchmarks.generate_gpu "${sizes[@]}" --batches 1 \
      --no-transformers --agreement-tokens 0 --json "$out/generate_gpu.json" ;;
  doctor)
    run doctor "$python" -m ulysses_jax.doctor --json "$out/doctor.json" ;;
  decode)
    run decode "$python" -m ulysses_jax.doctor --no_kernels --no_step --json "$out/decode.json" ;;
  profile-decode)
    if [[ $dry == 1 ]]; then prompts=(128); model=(--preset tiny-gqa --steps 2); else
      prompts=(32768 131072); model=(); fi
    for prompt in "${prompts[@]}"; do
      run "profile_decode_$prompt" "$python" -m benchmarks.profile_decode "${model[@]}" \
        --prompt "$prompt" --json "$out/profile_decode_$prompt.json"
    done ;;
  first-contact)
    need_gin
    run first_contact "$python" -m benchmarks.first_contact --out "$out/first_contact" \
      --mode "${FIRST_CONTACT_MODE:-gpu}" ${FIRST_CONTACT_CONFIGS:+--configs "$FIRST_CONTACT_CONFIGS"} ;;
  *)
    echo "unknown stage '$stage'; expected kernels, kernels-more, step-1b, step-1b-memory," \
      "memory-1b, memory-8b, memory-8b-bf16, memory-8b-master, peers, speed, sweep-d64-causal," \
      "sweep-d64-dkv, sweep-d64-full, sweep-d128, generate, generate-ours, doctor, decode," \
      "profile-decode or first-contact" >&2
    exit 2 ;;
esac
if (( ${#failed[@]} )); then
  echo "failed: ${failed[*]} (their logs are in $out)" >&2
  exit 1
fi
