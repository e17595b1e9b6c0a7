"""Double of ``networks.lora_anima``: the host's factory signatures (parameter names included),
building the shared small LoRA network of the ``networks.lora`` double."""

from networks import lora


def create_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet, neuron_dropout=None, **kwargs):
    return lora.create_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet, neuron_dropout=neuron_dropout, **kwargs)


def create_network_from_weights(multiplier, file, vae, text_encoders, unet, weights_sd=None, for_inference=False, **kwargs):
    return lora.create_network_from_weights(
        multiplier, file, vae, text_encoders, unet, weights_sd=weights_sd, for_inference=for_inference, **kwargs
    )
