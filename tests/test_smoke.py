import jax


def test_eight_cpu_devices():
    assert jax.device_count() == 8
