"""common.devices.collector_paused: the cyclic GC is off inside a capture and back as it was after, error or not."""
import gc

import pytest

from common.devices import collector_paused


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_inside_and_as_it_was_after_even_on_an_error(enabled_before):
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a failed capture")
        assert gc.isenabled() == enabled_before
    finally:
        (gc.enable if was else gc.disable)()
