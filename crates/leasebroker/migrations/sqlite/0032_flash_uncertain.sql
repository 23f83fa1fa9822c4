-- Issue 45: a Redfish flash whose outcome cannot be read, and the task a replica follows.
--
-- task_uri: where the BMC said the flash's task is followed (the task monitor's `Location` of an
-- accepted SimpleUpdate, or the task found by its tag), as a path on the BMC (never its host or
-- credentials). Kept with the operation so that whichever replica watches it, after a restart
-- or from another process, follows the same task.
--
-- state gains 'uncertain': the flash was sent, and what came of it cannot be read (no task
-- carries its tag, and the BMC serves no firmware inventory, or lists no tasks). The node takes
-- no other flash until an operator resolves the operation (succeeded or failed), with the reason
-- in resolution.
ALTER TABLE lb_flash_operations ADD COLUMN task_uri TEXT;
ALTER TABLE lb_flash_operations ADD COLUMN resolution TEXT;
DROP INDEX lb_flash_one_running_per_node;
CREATE UNIQUE INDEX lb_flash_one_open_per_node ON lb_flash_operations (node_id)
    WHERE state IN ('running', 'uncertain');
