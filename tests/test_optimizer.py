"""Learning-rate schedule values and the weight-decay mask."""

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxlm import optimizer
from tests.helpers import load_config


def test_schedule_warmup_peak_and_end():
  o = load_config('base').optim
  o.update(lr=1e-3, warmup_steps=100, final_lr_fraction=0.1)
  lr = optimizer.schedule(o, total_steps=1000)
  np.testing.assert_allclose(float(lr(0)), 0.0)
  np.testing.assert_allclose(float(lr(50)), 5e-4, rtol=1e-6)  # halfway up the linear warmup
  np.testing.assert_allclose(float(lr(100)), 1e-3, rtol=1e-6)  # end of warmup = peak
  np.testing.assert_allclose(float(lr(550)), 1e-3 * (0.1 + 0.9 * 0.5), rtol=1e-5)  # cosine midpoint
  np.testing.assert_allclose(float(lr(1000)), 1e-4, rtol=1e-6)  # last step: final fraction of the peak
  assert all(float(lr(s)) >= float(lr(s + 1)) for s in range(100, 1000, 50))


def test_decay_mask_skips_norms_even_when_stacked():
  specs = {'embedding': P('vocab', 'embed'), 'layers': {'norm': {'scale': P('layers', 'embed')},
                                                        'mlp': {'up': P('layers', 'embed', 'mlp')}},
           'final_norm': {'scale': P('embed')}}
  assert optimizer.decay_mask(specs) == {'embedding': True, 'layers': {'norm': {'scale': False},
                                                                      'mlp': {'up': True}},
                                         'final_norm': {'scale': False}}
