"""What the serving layer asks of any engine about the device it runs on (a generation engine or the
pooling engine): each holds its loaded model as `lm` (with `device`) and can `drop_model` (every tensor of it)."""

from node_agent.model import devices


class OnDevice:
    shares_device = False  # set by the device thread: another model's engine is attached there too

    def free(self) -> None:
        """On the device thread: `drop_model`, then give the device the memory it held back."""
        device = self.lm.device
        self.drop_model()
        devices.give_back_memory(device)

    def is_device_fault(self, exc: BaseException) -> bool:
        """Whether `exc` (from a step) is the device's fault: the model is then poisoned and reloaded."""
        return devices.is_device_fault(exc, self.lm.device)
