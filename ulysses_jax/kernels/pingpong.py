"""Ping-pong: the two compute warpgroups of a Mosaic kernel (``flash_hopper``'s forward,
``flash_hopper_backward``'s dq) taking turns on the tensor cores, one's elementwise work
beside the other's matmuls (FA3's schedule; JAX's ``attention_mgpu`` schedule barrier)."""

from jax.experimental.pallas import mosaic_gpu as plgpu


class PingPong:
  """Compute warpgroup ``w``'s turns on the tensor cores with the other one (``Tile.pingpong``):
  a barrier of two arrivals that each passes twice per block, once while its first matmul runs
  (``turn``, given as ``wgmma_forms.a_times_bt``'s ``while_running``) and once when its
  elementwise work is done, before its last matmul (``hand_over``). Warpgroup 1 starts one
  phase late and warpgroup 0 ends one late, so their phases alternate. Without ping-pong every
  method does nothing."""

  def __init__(self, smem, tile, w):
    self.barrier, self.w = (smem["schedule"] if tile.pingpong else None), w

  @staticmethod
  def buffers(tile):
    """The barrier, for ``with_shared_memory``, where ``tile`` asks for ping-pong."""
    return dict(schedule=plgpu.Barrier(num_arrivals=2)) if tile.pingpong else {}

  def turn(self):
    if self.barrier is not None:
      plgpu.barrier_arrive(self.barrier)
      plgpu.barrier_wait(self.barrier)

  def hand_over(self, wait_operand=lambda: None):
    """Lets the other warpgroup's matmuls go first; returns ``wait_operand()`` (e.g. waiting
    for the last matmul's operand to land), run in between."""
    if self.barrier is not None:
      plgpu.barrier_arrive(self.barrier)
    operand = wait_operand()
    if self.barrier is not None:
      plgpu.barrier_wait(self.barrier)
    return operand

  def start(self):
    if self.w == 1:
      self.turn()

  def end(self):
    if self.w == 0:
      self.turn()
