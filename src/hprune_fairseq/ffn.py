"""The feed-forward sublayer's hidden units (neurons) as prunable units: fc2 as `NeuronOutput`, an nn.Linear with

  * `neuron_mask`: one value per neuron present, multiplying fc2's input, the activation after fc1 (where Kwon et
    al.'s code puts its neuron mask: a forward pre-hook on BERT's output dense layer); 0 removes a neuron exactly;
  * `record_inputs`: keep the last call's (masked) input, in the autograd graph, for the mask gradients;
  * `neuron_ids`: the original ids of the neurons present, so masks keep the unpruned layout.

`keep_neurons` slices fc1's rows and fc2's columns (fc2's bias stays: a layer left with no neuron adds it
alone, as the masked layer does). State-dict keys are the stock ones; the module scripts with TorchScript
(recording is left out of a scripted module).
"""
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class NeuronOutput(nn.Linear):
    neuron_mask: Optional[Tensor]

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.neuron_ids: List[int] = list(range(in_features))
        self.total_neurons = in_features
        self.neuron_mask = None
        self.record_inputs = False
        self.neuron_inputs: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        mask = self.neuron_mask  # (a local: TorchScript refines Optional on locals only)
        if mask is not None:
            x = x * mask.to(x.dtype)
        if not torch.jit.is_scripting() and self.record_inputs:
            self._record(x)
        return F.linear(x, self.weight, self.bias)

    @torch.jit.unused
    def _record(self, x: Tensor) -> None:
        self.neuron_inputs = x

    def set_neuron_mask(self, mask) -> None:
        """`mask`: a value per neuron of the unpruned layout (total_neurons), or None (every neuron present)."""
        if mask is None:
            self.neuron_mask = None
            return
        mask = torch.as_tensor(mask, dtype=torch.float32, device=self.weight.device)
        if mask.shape != (self.total_neurons,):
            raise ValueError(f"neuron mask has shape {tuple(mask.shape)}, expected ({self.total_neurons},)")
        self.neuron_mask = mask[self.neuron_ids]

    @torch.no_grad()
    def scale_units(self, values: Tensor) -> None:
        """Each present neuron's fc2 column scaled by its value (mask tuning folds its scales in here)."""
        self.weight.mul_(values.to(self.weight.dtype).unsqueeze(0))


@torch.no_grad()
def keep_neurons(layer, keep_ids) -> None:
    """Physically keep only the neurons of transformer layer `layer` whose original ids are in keep_ids."""
    fc1, fc2 = layer.fc1, layer.fc2
    unknown = set(keep_ids) - set(fc2.neuron_ids)
    if unknown:
        raise ValueError(f"neurons {sorted(unknown)[:8]} are not present")
    keep = set(keep_ids)
    local = torch.tensor([i for i, n in enumerate(fc2.neuron_ids) if n in keep], dtype=torch.long,
                         device=fc1.weight.device)
    fc1.weight = nn.Parameter(fc1.weight.index_select(0, local))
    if fc1.bias is not None:
        fc1.bias = nn.Parameter(fc1.bias.index_select(0, local))
    fc1.out_features = fc2.in_features = len(local)
    fc2.weight = nn.Parameter(fc2.weight.index_select(1, local))
    if fc2.neuron_mask is not None:
        fc2.neuron_mask = fc2.neuron_mask[local]
    fc2.neuron_ids = [fc2.neuron_ids[i] for i in local.tolist()]
