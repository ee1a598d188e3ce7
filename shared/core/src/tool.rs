//! The infrastructure tools a Capsule can name: the store keeps the name (`capsules.tool`),
//! the views send it, and the runner picks the binary by it.

crate::text_enum! {
    /// The infrastructure tool a Capsule uses.
    pub enum Tool("tool") {
        /// HashiCorp Terraform.
        Terraform = "terraform",
        /// OpenTofu.
        Tofu = "tofu",
    }
}

impl Tool {
    /// The setting suffix naming its binary (`TAKOSUMI_<this>_BIN`).
    pub const fn env_name(self) -> &'static str {
        match self {
            Self::Terraform => "TERRAFORM",
            Self::Tofu => "TOFU",
        }
    }
}
