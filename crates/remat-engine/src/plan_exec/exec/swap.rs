//! An item's bytes moved between the device and the host store: swap-outs and prefetches
//! started, waited for, and host copies released.

use super::{Held, HostCopy, Runner};
use crate::core::pool::Category;
use crate::core::swap::Waited;
use crate::core::tensor::Tensor;
use crate::plan_exec::PlanExecError;
use crate::plan_exec::layout::ItemKind;

impl Runner<'_> {
    /// Waits for an item's prefetch, if one is in flight.
    pub(super) fn settle_incoming(&mut self, item: usize) -> Result<(), PlanExecError> {
        let Some((transfers, grad_slots)) = self.states[item].incoming.take() else {
            return Ok(());
        };
        let mut tensors = Vec::with_capacity(transfers.len());
        for t in transfers {
            let Waited { value, stall } = t.wait()?;
            self.note_stall(item, stall);
            tensors.push(value);
        }
        let held = self.states[item].held.get_or_insert_with(Held::default);
        held.tensors = tensors;
        held.grad_slots = grad_slots;
        Ok(())
    }

    /// Waits for an item's swap-out, if one is in flight; its host copy is then complete.
    pub(super) fn settle_outgoing(&mut self, item: usize) -> Result<(), PlanExecError> {
        let Some(transfers) = self.states[item].outgoing.take() else {
            return Ok(());
        };
        let mut slots = Vec::with_capacity(transfers.len());
        for t in transfers {
            let Waited {
                value: (slot, _device),
                stall,
            } = t.wait()?;
            self.note_stall(item, stall);
            slots.push(slot);
        }
        if let Some(host) = self.states[item].host.as_mut() {
            host.slots = slots;
        }
        Ok(())
    }

    /// Releases an item's host copy (waiting for a swap-out in flight first).
    pub(super) fn drop_host_copy(&mut self, item: usize) -> Result<(), PlanExecError> {
        self.settle_outgoing(item)?;
        if let Some(host) = self.states[item].host.take()
            && let Some(copy) = self.copy
        {
            for slot in host.slots {
                copy.store().release(slot)?;
            }
        }
        Ok(())
    }

    pub(super) fn swap_out(&mut self, k: usize, item: usize) -> Result<(), PlanExecError> {
        let copy = self.copy.ok_or_else(|| PlanExecError::NoHostStore {
            step: k,
            item: self.name(item).to_string(),
        })?;
        self.settle_incoming(item)?;
        let state = &mut self.states[item];
        let Some(held) = state.held.as_ref() else {
            return Err(PlanExecError::NotResident {
                step: k,
                item: format!("swap-out of {}", self.layout.items[item].name),
                input: self.layout.items[item].name.clone(),
            });
        };
        if state.host.is_some() || state.outgoing.is_some() {
            // Already on the host (an earlier swap-out of the same, unchanged tensor).
            return Ok(());
        }
        let name = &self.layout.items[item].name;
        let mut transfers = Vec::with_capacity(held.tensors.len());
        let mut metas = Vec::with_capacity(held.tensors.len());
        for t in &held.tensors {
            metas.push((t.shape().to_vec(), t.dtype(), t.category()));
            self.report.swapped_out_bytes += t.bytes();
            transfers.push(copy.offload(t.clone(), name)?);
        }
        state.host = Some(HostCopy {
            slots: Vec::new(),
            metas,
            grad_slots: held.grad_slots.clone(),
        });
        state.outgoing = Some(transfers);
        Ok(())
    }

    pub(super) fn swap_in(&mut self, k: usize, item: usize) -> Result<(), PlanExecError> {
        let copy = self.copy.ok_or_else(|| PlanExecError::NoHostStore {
            step: k,
            item: self.name(item).to_string(),
        })?;
        self.settle_outgoing(item)?;
        if self.states[item].held.is_some() || self.states[item].incoming.is_some() {
            return Err(PlanExecError::AlreadyResident {
                step: k,
                item: self.name(item).to_string(),
            });
        }
        let reserved_only = match self.layout.items[item].kind {
            ItemKind::Workspace { .. } => true,
            ItemKind::Grad { .. } => !self.states[item].written,
            _ => false,
        };
        if reserved_only {
            // Nothing written: bytes to reserve, nothing to copy.
            let held = self.reserve(item)?;
            self.states[item].held = Some(held);
            self.drop_host_copy(item)?;
            return Ok(());
        }
        let Some(host) = self.states[item].host.as_ref() else {
            return Err(PlanExecError::NotOnHost {
                step: k,
                item: self.name(item).to_string(),
            });
        };
        let release = self.last_swap_in[item] == Some(k);
        let (node, category) = match self.layout.items[item].kind {
            ItemKind::Forward { node } | ItemKind::Backward { node } => (Some(node), None),
            ItemKind::Grad { leaf } => (Some(leaf), Some(Category::Gradients)),
            ItemKind::Workspace { .. } | ItemKind::End => (None, None),
        };
        let mut transfers = Vec::with_capacity(host.slots.len());
        for (&slot, (shape, dtype, cat)) in host.slots.iter().zip(&host.metas) {
            let dst = Tensor::zeros(&self.pool, shape, *dtype, category.unwrap_or(*cat), node)
                .map_err(|e| e.at(&self.layout.items[item].name))?;
            self.report.swapped_in_bytes += dst.bytes();
            transfers.push(copy.prefetch(slot, dst, release)?);
        }
        let grad_slots = host.grad_slots.clone();
        let state = &mut self.states[item];
        if release {
            // The copy worker releases the slots after this last prefetch.
            state.host = None;
        }
        state.incoming = Some((transfers, grad_slots));
        Ok(())
    }
}
