"""Double of ``lycoris.kohya`` 4.1.3: its factory signatures (``warn_on_unmatched``, no
``neuron_dropout``: dropout arrives as the ``dropout`` kwarg) and an ``on_step_start`` no-op."""

from networks.lora import LoRANetwork
from networks.lora import create_network_from_weights as _from_weights


class LycorisNetworkKohya(LoRANetwork):
    def on_step_start(self, *args) -> None:
        pass


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, warn_on_unmatched=True, **kwargs):
    return LycorisNetworkKohya(unet, multiplier, int(network_dim or 4), float(network_alpha or 1.0), **kwargs)


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False, **kwargs):
    return _from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=weights_sd, for_inference=for_inference, **kwargs)
